"""Quality of patch dropping + INT4 on real VLM checkpoints, measured through the language model.

For one VLM checkpoint (LLaVA, SmolVLM / Idefics3, Qwen2.5-VL) and a few photos, every photo
is encoded by `EncoderPipeline` under each of `CONFIGS`:

    reference   pruning "none",    fp32 tokens   the checkpoint's own rows (exact mode)
    optimized   pruning "dynamic", int4 tokens   the serving default
    int4_only   pruning "none",    int4 tokens   storage effect alone
    drop_only   pruning "dynamic", fp32 tokens   patch-dropping effect alone

Non-exact paths also decode at reduced scale where the family allows it (LLaVA, Idefics3), so
`int4_only` and `drop_only` carry that effect too; `reference` decodes at full size.

Each encoding goes into the checkpoint's language model as the engine runs it (`render` with
the processor's chat template, `embed_positions`, one `run_step` slice over a `SeqKV`, M-RoPE
positions where the family has them) with a fixed question per photo, and its next-token
logits and a short greedy continuation are compared with those of the reference encoding
(anchor: the first reference encode). The `reference` row is a second, independent encode and
forward of the exact path: it shows the comparison itself is exact (top-1 1.0, cosine 1.0).
`wrong_image` asks each photo's question about another photo's reference encoding: the
agreement a wrong image gets, the scale the other rows are read against.

Encodes of all configs interleave photo by photo (order rotated each repeat), in one process,
so machine noise hits every config alike. Encode ms is the wall time of
`EncoderPipeline.encode_batch([image])` (decode included); images/s is 1000 / its mean (batch
1: VLM checkpoints are encoded image by image). Payload bytes are the stored form's
`to_bytes()` length (header included).

Nothing here is downloaded; checkpoints are local directories (safetensors only). The table
and the chart of the results: `bench/_encoder_vlm_report.py`.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from encoder_worker.config import EncoderConfig
from encoder_worker.pipeline import EncoderPipeline
from encoder_worker.types import ENCODE_STAGES, EncodedImage, ImageError
from gateway.engine.interface import ImageInput, Message
from gateway.engine.local.batch import SeqKV, Slice, cache_param, install_attention, run_step
from gateway.engine.local.prompt import Prompt, embed_positions, render
from gateway.engine.local.weights import LoadedModel, load_weights

__all__ = (
    "CONFIGS",
    "QUESTIONS",
    "TABLE_FIELDS",
    "TINY_FAMILIES",
    "build_tiny_checkpoints",
    "measure_checkpoint",
)

# name -> (pruning, visual_tokens); the first is the reference every other row is compared to
CONFIGS: dict[str, tuple[str, str]] = {
    "reference": ("none", "fp32"),
    "optimized": ("dynamic", "int4"),
    "int4_only": ("none", "int4"),
    "drop_only": ("dynamic", "fp32"),
}
REFERENCE, OPTIMIZED = "reference", "optimized"

QUESTIONS: dict[str, str] = {
    "astronaut": "What is the person in this photo wearing?",
    "chelsea": "What animal is this, and what color is its fur?",
    "coffee": "What drink is in the cup, and what is under it?",
    "rocket": "What is happening in this picture?",
    "hubble_deep_field": "What kind of objects fill this image?",
    "immunohistochemistry": "What does this microscope image show?",
}
DEFAULT_QUESTION = "Describe this image in one sentence."

# Every config row of the table carries these fields.
TABLE_FIELDS = (
    "pruning",
    "visual_tokens",
    "top1_agreement",
    "logit_cosine_mean",
    "logit_cosine_min",
    "greedy_agreement",
    "greedy_prefix_mean",
    "tokens_kept_mean",
    "tokens_total_mean",
    "tokens_kept_ratio",
    "encode_ms_mean",
    "encode_ms_median",
    "stage_ms_median",
    "images_per_s",
    "payload_bytes_mean",
)

TINY_FAMILIES = ("llava", "idefics3", "qwen2_5_vl")

Progress = Callable[[str], None]


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# -- tiny random-weight checkpoints ------------------------------------------------------------


def checkpoint_builder(family: str, needed_by: str) -> Any:
    """The module of the repository's `tests/vlm_checkpoints` that builds `family`'s random-weight
    checkpoints (`build(path, ...)`), found in the checkout (not shipped in a wheel).

    Raises RuntimeError naming `needed_by` when the checkout's builders are not there."""
    import importlib

    repo = Path(__file__).resolve().parents[1]
    if (repo / "tests" / "vlm_checkpoints").is_dir() and str(repo) not in sys.path:
        sys.path.append(str(repo))  # the checkout's root, when run from elsewhere
    try:
        return importlib.import_module(f"tests.vlm_checkpoints.{family}")
    except ImportError as exc:
        raise RuntimeError(
            f"{needed_by} needs the checkpoint builders in tests/vlm_checkpoints: run it "
            f"from a repository checkout ({exc})"
        ) from None


def build_tiny_checkpoints(
    root: Path, families: tuple[str, ...] = TINY_FAMILIES, seed: int = 0
) -> list[Path]:
    """Build the tiny random-weight checkpoints of `families` under `root` with the builders
    in the repository's `tests/vlm_checkpoints` (a checkout, not an installed wheel).

    Raises RuntimeError with the reason when the builders or the SmolLM2 tokenizer they use
    are missing."""
    out = []
    for family in families:
        builder = checkpoint_builder(family, "--tiny-families")
        try:
            out.append(Path(builder.build(root / family, seed=seed)))
        except OSError as exc:
            raise RuntimeError(
                f"building the tiny {family} checkpoint failed ({exc}); the builders use the "
                "converted SmolLM2 tokenizer: run `visiongate convert` first"
            ) from None
    return out


# -- the language-model side -------------------------------------------------------------------


@dataclass(slots=True)
class _LM:
    w: LoadedModel
    cache_arg: str
    num_layers: int
    kv_heads: int
    head_dim: int


def _load_lm(checkpoint: Path, device: str, dtype: str) -> _LM:
    w = load_weights(checkpoint, device=device, dtype=dtype)
    install_attention(w.model)
    text = w.model.config.get_text_config()
    heads = int(text.num_attention_heads)
    return _LM(
        w=w,
        cache_arg=cache_param(w.decoder),
        num_layers=int(text.num_hidden_layers),
        kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // heads),
    )


@dataclass(slots=True)
class _Answer:
    logits: torch.Tensor  # [vocab] float32, next token after the prompt
    greedy: list[int]  # greedy continuation, `steps` tokens (EOS not special)
    prompt_tokens: int


@torch.inference_mode()
def _answer(lm: _LM, prompt: Prompt, steps: int) -> _Answer:
    """Prefill the prompt in one `run_step` slice, then decode `steps - 1` greedy tokens."""
    w = lm.w
    n = prompt.length
    kv = SeqKV(lm.num_layers, lm.kv_heads, lm.head_dim, n + steps + 1, w.dtype, w.device)
    embeds = embed_positions(w.embed, prompt, 0, w.dtype, w.device)[0]  # [n, H]
    if w.mrope:
        positions = (
            prompt.mrope if prompt.mrope is not None else torch.arange(n).expand(3, -1)
        ).to(w.device)  # [3, n]
    else:
        positions = torch.arange(n, device=w.device)  # [n]
    logits = run_step(
        w.decoder,
        w.lm_head,
        [Slice(kv, 0, n, embeds, positions, True)],
        mrope=w.mrope,
        cache_arg=lm.cache_arg,
    )[0]  # [vocab]
    first = logits.float().cpu()
    greedy = [int(first.argmax())]
    delta = prompt.rope_delta if w.mrope else 0
    for i in range(steps - 1):
        at = n + i
        ids = torch.tensor([greedy[-1]], device=w.device)
        row = w.embed(ids).to(w.dtype)  # [1, H]
        pos = torch.tensor([at + delta], device=w.device)
        if w.mrope:
            pos = pos.expand(3, -1)  # [3, 1]
        step = run_step(
            w.decoder,
            w.lm_head,
            [Slice(kv, at, 1, row, pos, True)],
            mrope=w.mrope,
            cache_arg=lm.cache_arg,
        )[0]
        greedy.append(int(step.argmax()))
    return _Answer(first, greedy, n)


def _prompt(lm: _LM, encoded: EncodedImage, question: str) -> Prompt:
    image = ImageInput(
        f"{encoded.fingerprint}:{encoded.digest}",
        encoded.embeds(lm.w.device),
        layout=encoded.layout,
    )
    return render(lm.w.tokenizer, [Message("user", [image, question])], add_generation_prompt=True)


# -- one checkpoint ----------------------------------------------------------------------------


def _encode(pipe: EncoderPipeline, data: bytes) -> tuple[EncodedImage, float]:
    t = time.perf_counter()
    (result,) = pipe.encode_batch([data])
    ms = (time.perf_counter() - t) * 1e3
    if isinstance(result, ImageError):
        raise RuntimeError(f"encode failed: {result.code}: {result.message}")
    return result, ms


def _build_pipelines(checkpoint: Path, device: str) -> dict[str, EncoderPipeline]:
    pipes: dict[str, EncoderPipeline] = {}
    for name, (pruning, tokens) in CONFIGS.items():
        cfg = EncoderConfig(
            tower=str(checkpoint), pruning=pruning, visual_tokens=tokens, device=device
        )
        pipe = EncoderPipeline(cfg, None)
        if pipes:  # one copy of the checkpoint's encoder serves every config (it is stateless)
            pipe.family = next(iter(pipes.values())).family
        pipes[name] = pipe
    return pipes


def measure_checkpoint(
    checkpoint: Path,
    photos: dict[str, bytes],
    *,
    repeats: int = 2,
    steps: int = 8,
    device: str = "auto",
    lm_dtype: str = "auto",
    random_weights: bool = False,
    progress: Progress = _stderr,
) -> dict[str, Any]:
    """The quality/speed table of one VLM checkpoint (see the module doc); JSON-able."""
    if repeats < 1 or steps < 1 or not photos:
        raise ValueError("repeats and steps must be >= 1 and photos non-empty")
    checkpoint = Path(checkpoint)
    pipes = _build_pipelines(checkpoint, device)
    family = pipes[REFERENCE].family.name
    progress(f"[{family}] loading the language model of {checkpoint}")
    lm = _load_lm(checkpoint, device, lm_dtype)
    names = list(photos)
    for pipe in pipes.values():  # warm every path once
        _encode(pipe, photos[names[0]])

    ms: dict[str, dict[str, list[float]]] = {c: {n: [] for n in names} for c in CONFIGS}
    stages: dict[str, dict[str, list[float]]] = {c: {s: [] for s in ENCODE_STAGES} for c in CONFIGS}
    first: dict[str, EncodedImage] = {}  # the anchor: first reference encode of each photo
    last: dict[str, dict[str, EncodedImage]] = {c: {} for c in CONFIGS}
    order = list(CONFIGS)
    for r in range(repeats):
        rotated = order[r % len(order) :] + order[: r % len(order)]
        for name in names:
            for c in rotated:
                enc, t = _encode(pipes[c], photos[name])
                ms[c][name].append(t)
                for stage in ENCODE_STAGES:
                    stages[c][stage].append(enc.timings_ms.get(stage, 0.0))
                if c == REFERENCE and name not in first:
                    first[name] = enc
                last[c][name] = enc
                progress(
                    f"[{family}] repeat {r + 1}/{repeats} {name:<21} {c:<10} {t:8.1f} ms "
                    f"{enc.tokens_kept}/{enc.tokens_total} tokens"
                )
    for pipe in pipes.values():
        pipe.close()

    anchors = {}
    for name in names:
        anchors[name] = _answer(lm, _prompt(lm, first[name], _question(name)), steps)
    wrong = _wrong_image_floor(lm, names, first, anchors, steps)
    rows: dict[str, dict[str, Any]] = {}
    for c, (pruning, tokens) in CONFIGS.items():
        per_photo = {}
        for name in names:
            enc = last[c][name]
            # the reference row re-runs the anchor's forward on a separate encode
            ans = _answer(lm, _prompt(lm, enc, _question(name)), steps)
            ref = anchors[name]
            agree = [a == b for a, b in zip(ans.greedy, ref.greedy, strict=False)]
            prefix = agree.index(False) if False in agree else len(agree)
            per_photo[name] = {
                "top1_agrees": bool(ans.greedy[0] == ref.greedy[0]),
                "logit_cosine": float(F.cosine_similarity(ans.logits, ref.logits, dim=0)),
                "greedy_agrees": ans.greedy == ref.greedy,
                "greedy_prefix": prefix,
                "greedy_tokens": ans.greedy,
                "tokens_kept": enc.tokens_kept,
                "tokens_total": enc.tokens_total,
                "prompt_tokens": ans.prompt_tokens,
                "encode_ms": ms[c][name],
                "payload_bytes": len(enc.payload.to_bytes()),  # type: ignore[attr-defined]
            }
            progress(
                f"[{family}] {name:<21} {c:<10} top-1 "
                f"{'=' if per_photo[name]['top1_agrees'] else 'x'} cosine "
                f"{per_photo[name]['logit_cosine']:.4f} greedy {prefix}/{steps}"
            )
        rows[c] = _row(pruning, tokens, per_photo, stages[c], steps)
    ref, opt = rows[REFERENCE], rows[OPTIMIZED]
    result = {
        "family": family,
        "checkpoint": str(checkpoint),
        "random_weights": random_weights,
        "device": str(lm.w.device),
        "lm_dtype": str(lm.w.dtype),
        "encoder_dtype": str(pipes[REFERENCE].dtype),
        "lm_hidden_size": lm.w.hidden_size,
        "repeats": repeats,
        "greedy_steps": steps,
        "photos": names,
        "questions": {n: _question(n) for n in names},
        "anchor_greedy_tokens": {n: anchors[n].greedy for n in names},
        "configs": rows,
        "wrong_image": wrong,
        "summary": {
            "top1_agreement": opt["top1_agreement"],
            "logit_cosine_mean": opt["logit_cosine_mean"],
            "greedy_agreement": opt["greedy_agreement"],
            "tokens_kept_ratio": opt["tokens_kept_ratio"],
            "encode_speedup_vs_reference": ref["encode_ms_mean"] / opt["encode_ms_mean"],
            "images_per_s_ratio_vs_reference": opt["images_per_s"] / ref["images_per_s"],
            "encode_speedup_median_vs_reference": ref["encode_ms_median"] / opt["encode_ms_median"],
            "payload_bytes_ratio_vs_reference": opt["payload_bytes_mean"]
            / ref["payload_bytes_mean"],
        },
    }
    return result


def _wrong_image_floor(
    lm: _LM,
    names: list[str],
    first: dict[str, EncodedImage],
    anchors: dict[str, _Answer],
    steps: int,
) -> dict[str, float] | None:
    """Each photo's question asked about the next photo's reference encoding, compared with the
    right image's answer: what the agreement numbers look like when the image is wrong (None
    with one photo)."""
    if len(names) < 2:
        return None
    top1, cosine = [], []
    for i, name in enumerate(names):
        other = first[names[(i + 1) % len(names)]]
        ans = _answer(lm, _prompt(lm, other, _question(name)), steps)
        top1.append(float(ans.greedy[0] == anchors[name].greedy[0]))
        cosine.append(float(F.cosine_similarity(ans.logits, anchors[name].logits, dim=0)))
    return {"top1_agreement": statistics.fmean(top1), "logit_cosine_mean": statistics.fmean(cosine)}


def _question(name: str) -> str:
    return QUESTIONS.get(name, DEFAULT_QUESTION)


def _row(
    pruning: str,
    tokens: str,
    per_photo: dict[str, dict],
    stages: dict[str, list[float]],
    steps: int,
) -> dict[str, Any]:
    """One config's row of the table: `TABLE_FIELDS` plus the per-photo details."""
    v = list(per_photo.values())
    all_ms = [t for p in v for t in p["encode_ms"]]
    mean_ms = statistics.fmean(all_ms)
    kept = statistics.fmean(p["tokens_kept"] for p in v)
    total = statistics.fmean(p["tokens_total"] for p in v)
    row = {
        "pruning": pruning,
        "visual_tokens": tokens,
        "top1_agreement": statistics.fmean(float(p["top1_agrees"]) for p in v),
        "logit_cosine_mean": statistics.fmean(p["logit_cosine"] for p in v),
        "logit_cosine_min": min(p["logit_cosine"] for p in v),
        "greedy_agreement": statistics.fmean(float(p["greedy_agrees"]) for p in v),
        "greedy_prefix_mean": statistics.fmean(p["greedy_prefix"] / steps for p in v),
        "tokens_kept_mean": kept,
        "tokens_total_mean": total,
        "tokens_kept_ratio": statistics.fmean(p["tokens_kept"] / p["tokens_total"] for p in v),
        "encode_ms_mean": mean_ms,
        "encode_ms_median": statistics.median(all_ms),
        "images_per_s": 1e3 / mean_ms,
        "payload_bytes_mean": statistics.fmean(p["payload_bytes"] for p in v),
        "stage_ms_median": {k: statistics.median(t) for k, t in stages.items()},
        "per_photo": per_photo,
    }
    return row
