"""Embeds mode in front of a real vLLM serving a LLaVA checkpoint (the random-weight test
fixture with 2 text heads of 32, its weights named as transformers 4 saved them, which is what
vLLM's loader reads): the visual tokens go as one [N, hidden] tensor per image, no grid.

What it shows beside `test_real_vllm` (Qwen2.5-VL, M-RoPE): the gateway's exact tokens give the
prompt vLLM builds from the photo itself, and pruned tokens are a valid (shorter) prompt, since
LLaVA places the rows it is given in order.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.testing.vllm_server import VllmServer, vllm_missing
from tests.gateway.engine.upstream.test_real_vllm import direct, gateway, greedy, photo_turn

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(vllm_missing() is not None, reason=vllm_missing() or ""),
    pytest.mark.timeout(900),
]

SERVED = "org/tiny-llava"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.vlm_checkpoints import llava

    return llava.build(
        tmp_path_factory.mktemp("llava") / "tiny-llava",
        key_layout="vision_model",
        text_overrides={"num_attention_heads": 2, "num_key_value_heads": 1},
    )


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    with VllmServer(
        checkpoint,
        served_model_name=SERVED,
        mm_embeds=True,
        max_model_len=2048,
        log_dir=tmp_path_factory.mktemp("vllm-llava-logs"),
    ) as running:
        yield running


def ask(client, **extra):
    return greedy(client, photo_turn(), model=SERVED, **extra)


def test_llava_embeds_answer_with_vllms_own_prompt(server: VllmServer, checkpoint: Path) -> None:
    alone = ask(direct(server))
    exact = {"pruning": "none", "visual_tokens": "fp32"}
    with gateway(server, upstream_images="embeds", model_path=str(checkpoint), **exact) as client:
        through = ask(client)
    with gateway(
        server, upstream_images="embeds", model_path=str(checkpoint), pruning="dynamic"
    ) as client:
        pruned = ask(client)
    assert through.usage.prompt_tokens == alone.usage.prompt_tokens
    assert through.choices[0].message.content
    # the first tokens agree; later ones may not (see docs/guides/upstream-engines.md)
    assert (
        through.choices[0].message.content.split()[0] == alone.choices[0].message.content.split()[0]
    )
    assert 0 < pruned.usage.prompt_tokens < alone.usage.prompt_tokens
    assert pruned.choices[0].message.content
