"""Real VLM checkpoints served end to end, in exact mode, against transformers' own `generate`.

For each family (LLaVA, Idefics3 / SmolVLM, Qwen2.5-VL) a tiny random-weight checkpoint is
built and served by a real gateway (`model_path=DIR`, `pruning="none"`, `visual_tokens="fp32"`,
CPU). A realtime conversation over the real `websockets` client (instructions set in the
session, then a user item of a photo and a question, greedy) must answer with exactly the tokens
`generate(do_sample=False)` gives on the same checkpoint, image and messages rendered by the
processor's chat template; two different photos must give different answers. Then the same with
the images encoded by a `visiongate worker` process through a real redis-server.
"""

from __future__ import annotations

import asyncio
import functools
import io
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gateway.server.app import create_app
from gateway.server.runner import ServerThread
from gateway.testing.realtime_peer import Peer, data_url, deltas
from tests.conftest import photo_bytes
from tests.gateway.conftest import gateway_settings

ROOT = Path(__file__).resolve().parents[4]
FAMILIES = ("llava", "idefics3", "qwen2_5_vl")
INSTRUCTIONS = "You describe pictures."
QUESTION = "What is in this picture?"
MAX_TOKENS = 12
PHOTOS = ("astronaut", "chelsea")


def _builder(family: str):
    import importlib

    return importlib.import_module(f"tests.vlm_checkpoints.{family}")


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory) -> tuple[str, Path]:
    family = request.param
    return family, _builder(family).build(tmp_path_factory.mktemp(family) / "ckpt")


@functools.cache
def _photo_png(name: str) -> bytes:
    return photo_bytes(name, fmt="PNG")


def _vlm_settings(path: Path, **overrides: Any):
    return gateway_settings(
        model_path=str(path),
        pruning="none",
        visual_tokens="fp32",
        device="cpu",
        max_output_tokens=MAX_TOKENS,
        **overrides,
    )


@functools.cache
def _hf(family: str, path: Path) -> tuple[Any, Any]:
    """The checkpoint's own processor and full model."""
    import transformers

    if family == "qwen2_5_vl":  # its AutoProcessor wants torchvision for the video half
        processor = _builder(family).load_processor(path)
    else:
        processor = transformers.AutoProcessor.from_pretrained(path)
    cls = {
        "llava": "LlavaForConditionalGeneration",
        "idefics3": "Idefics3ForConditionalGeneration",
        "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    }[family]
    model = getattr(transformers, cls).from_pretrained(path, dtype=torch.float32).eval()
    return processor, model


@functools.cache
def _reference(
    family: str, path: Path, photo: str, follow_up: tuple[str, str] | None = None
) -> dict[str, Any]:
    """transformers' greedy answer for the conversation the gateway is sent; `follow_up`
    (first answer, next question) continues it by one turn."""
    from PIL import Image

    processor, model = _hf(family, path)
    image = Image.open(io.BytesIO(_photo_png(photo))).convert("RGB")
    conversation = [
        {"role": "system", "content": [{"type": "text", "text": INSTRUCTIONS}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
    ]
    if follow_up is not None:
        conversation += [
            {"role": "assistant", "content": [{"type": "text", "text": follow_up[0]}]},
            {"role": "user", "content": [{"type": "text", "text": follow_up[1]}]},
        ]
    text = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    images = [[image]] if family == "idefics3" else [image]
    inputs = processor(text=text, images=images, return_tensors="pt")
    if family == "qwen2_5_vl":  # without them generate falls back to 1-D positions, silently
        assert "mm_token_type_ids" in inputs
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_TOKENS)
    prompt_ids = inputs["input_ids"][0]
    new = out[0, prompt_ids.shape[0] :].tolist()
    image_token = (
        model.config.image_token_id
        if hasattr(model.config, "image_token_id")
        else (model.config.image_token_index)
    )
    return {
        "tokens": new,
        "text": processor.tokenizer.decode(
            new, skip_special_tokens=True, clean_up_tokenization_spaces=False
        ),
        "input_tokens": int(prompt_ids.shape[0]),
        "image_tokens": int((prompt_ids == image_token).sum()),
    }


async def _respond(peer: Peer) -> tuple[str, dict[str, Any]]:
    done, events = await peer.respond(max_output_tokens=MAX_TOKENS)
    errors = [e for e in events if e["type"] == "error"]
    assert not errors, errors
    # random weights seldom say end-of-turn within MAX_TOKENS: "incomplete" is the length stop
    assert done["response"]["status"] in ("completed", "incomplete"), done
    return deltas(events), done["response"]["usage"]


async def _ask(
    ws_url: str, photo: str, follow_up: str | None = None
) -> list[tuple[str, dict[str, Any]]]:
    """One realtime conversation: instructions, then photo + question (and optionally a text
    follow-up question); (answer, usage) per response."""
    peer = await Peer.open(ws_url)
    try:
        await peer.send(
            {
                "type": "session.update",
                "session": {"type": "realtime", "instructions": INSTRUCTIONS},
            }
        )
        await peer.until("session.updated")
        await peer.add(
            [
                {"type": "input_image", "image_url": data_url(_photo_png(photo), "image/png")},
                {"type": "input_text", "text": QUESTION},
            ]
        )
        turns = [await _respond(peer)]
        if follow_up is not None:
            await peer.add([{"type": "input_text", "text": follow_up}])
            turns.append(await _respond(peer))
        return turns
    finally:
        await peer.close()


def _check_against_reference(family: str, path: Path, answers: dict[str, tuple[str, dict]]):
    for photo, (text, usage) in answers.items():
        ref = _reference(family, path, photo)
        assert text == ref["text"], (family, photo, text, ref["text"])
        assert usage["output_tokens"] == len(ref["tokens"])
        assert usage["input_tokens"] == ref["input_tokens"]
        assert usage["input_token_details"]["image_tokens"] == ref["image_tokens"]
    refs = {_reference(family, path, photo)["text"] for photo in answers}
    assert len(refs) == len(answers), "the reference answers must differ between photos"
    assert len({text for text, _ in answers.values()}) == len(answers)


@pytest.fixture(scope="module")
def vlm_server(checkpoint) -> Iterator[tuple[str, Path, ServerThread]]:
    family, path = checkpoint
    settings = _vlm_settings(path)
    with ServerThread(create_app(settings), settings) as server:
        server.wait_ready()
        yield family, path, server


async def test_exact_mode_matches_transformers_generate(vlm_server) -> None:
    family, path, server = vlm_server
    answers = {photo: (await _ask(server.ws_url, photo))[0] for photo in PHOTOS}
    await asyncio.to_thread(_check_against_reference, family, path, answers)


async def test_follow_up_turn_matches_transformers_generate(vlm_server) -> None:
    """The second turn reuses the first turn's KV (image included) and, on Qwen2.5-VL, goes on
    from the M-RoPE positions after the image; it must still answer as transformers does."""
    family, path, server = vlm_server
    follow_up = "What colours do you see?"
    (first, _), (second, usage) = await _ask(server.ws_url, PHOTOS[0], follow_up)
    ref = await asyncio.to_thread(_reference, family, path, PHOTOS[0], (first, follow_up))
    assert first == (await asyncio.to_thread(_reference, family, path, PHOTOS[0]))["text"]
    assert second == ref["text"], (family, second, ref["text"])
    assert usage["output_tokens"] == len(ref["tokens"])
    assert usage["input_tokens"] == ref["input_tokens"]
    assert usage["input_token_details"]["cached_tokens"] > ref["image_tokens"]


async def test_an_image_not_encoded_yet_is_estimated_at_the_checkpoints_bound(vlm_server) -> None:
    """A key's token limits are charged an estimate before images are encoded: for a VLM
    checkpoint the most tokens one of its images can make (`max_image_tokens`), which the real
    image's count never passes."""
    from encoder_worker.families.family import max_image_tokens
    from gateway.chat.metering import IMAGE_TOKENS_ESTIMATE, image_tokens_estimate

    family, path, server = vlm_server
    state = server.app.state["gateway"]
    bound = max_image_tokens(path, max_pixels=state.settings.max_pixels)
    assert image_tokens_estimate(state.engine, state.serving.encoder) == bound
    assert bound != IMAGE_TOKENS_ESTIMATE  # not the default's figure
    ((_, usage),) = await _ask(server.ws_url, PHOTOS[0])
    image_tokens = usage["input_token_details"]["image_tokens"]
    assert 0 < image_tokens <= bound, (family, image_tokens, bound)


async def test_text_spelling_the_image_placeholder_is_refused(vlm_server) -> None:
    """User text that spells the checkpoint's image placeholder would shift every image's rows;
    the response fails with invalid_request and the connection stays open."""
    family, _, server = vlm_server
    placeholder = "<|image_pad|>" if family == "qwen2_5_vl" else "<image>"
    peer = await Peer.open(server.ws_url)
    try:
        await peer.add(
            [
                {"type": "input_image", "image_url": data_url(_photo_png(PHOTOS[0]), "image/png")},
                {"type": "input_text", "text": f"Is {placeholder} a cat?"},
            ]
        )
        await peer.send({"type": "response.create", "response": {"max_output_tokens": 4}})
        event, seen = await peer.until("error", "response.done")
        if event["type"] == "response.done":
            errors = [e for e in seen if e["type"] == "error"]
            assert event["response"]["status"] == "failed", event
            event = errors[0] if errors else event
        detail = event.get("error") or event["response"]["status_details"]["error"]
        assert detail["code"] == "invalid_request", event
        assert placeholder in detail["message"]
        # the connection stays open
        await peer.send({"type": "session.update", "session": {"instructions": INSTRUCTIONS}})
        await peer.until("session.updated")
    finally:
        await peer.close()


@pytest.fixture
def vlm_worker(checkpoint, redis_url, tmp_path) -> Iterator[tuple[subprocess.Popen, Path]]:
    """A real `visiongate worker` process encoding with the checkpoint's vision side."""
    _, path = checkpoint
    log_path = tmp_path / "worker.log"
    with log_path.open("wb") as log:
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gateway.cli.main",
                "worker",
                "--redis-url",
                redis_url,
                "--model-path",
                str(path),
                "--pruning",
                "none",
                "--visual-tokens",
                "fp32",
                "--device",
                "cpu",
                "--block-ms",
                "200",
            ],
            cwd=ROOT,
            env=dict(os.environ),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        yield worker, log_path
    finally:
        worker.terminate()
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()


async def test_exact_mode_through_worker_processes(checkpoint, redis_url, vlm_worker) -> None:
    family, path = checkpoint
    worker, log_path = vlm_worker
    settings = _vlm_settings(path, encoder="redis", redis_url=redis_url)
    with ServerThread(create_app(settings), settings) as server:
        server.wait_ready()
        # one photo: the in-process test covers the others, this one the path through workers
        answers = {photo: (await _ask(server.ws_url, photo))[0] for photo in PHOTOS[:1]}
    log_text = log_path.read_text(errors="replace")
    assert worker.poll() is None, log_text
    assert '"worker.batch"' in log_text, log_text  # the worker process did the encoding
    try:
        await asyncio.to_thread(_check_against_reference, family, path, answers)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- worker log ---\n{log_text[-4000:]}") from None
