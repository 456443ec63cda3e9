"""Identity and key-wise reading of a real VLM checkpoint directory (safetensors only).

`checkpoint_id(dir)` is what the encoder fingerprint calls the checkpoint's weights id. It is
computed from the files alone, without building any model, so a gateway that hands encoding
to remote workers gets the same value as the workers that load the tower. It covers:

- every `*.json` / `*.jinja` file of the directory (config, processor and tokenizer configs),
  by name and content;
- every `*.safetensors` file by name, size and header (tensor names, dtypes, shapes, offsets);
- the raw bytes of the encoder-side tensors (vision tower, projector / connector / merger),
  read straight from their byte ranges, so a fine-tune with identical shapes still changes it.

The result is memoized per process by (path, file names, sizes, mtimes).

`read_tensors(dir, want)` loads tensors by key with `safetensors.safe_open`: only the keys
asked for are materialized; nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    import torch

__all__ = ("ENCODER_KEY_PARTS", "checkpoint_id", "read_tensors", "safetensors_index")

# A tensor belongs to the encoder side when one of its dotted name parts is one of these
# (LLaVA: vision_tower, multi_modal_projector; Idefics3: vision_model, connector; Qwen2.5-VL:
# visual).
ENCODER_KEY_PARTS = frozenset(
    (
        "vision_tower",
        "multi_modal_projector",
        "vision_model",
        "connector",
        "visual",
        "image_newline",
    )
)
_MAX_HEADER = 100 * 1024 * 1024
_CACHE: dict[tuple, str] = {}


def _header(path: Path) -> tuple[bytes, dict]:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER:
            raise ValueError(f"{path}: safetensors header of {n} bytes is implausible")
        raw = f.read(n)
    try:
        meta = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"{path}: unreadable safetensors header ({exc})") from None
    return raw, meta


def safetensors_index(checkpoint_dir: str | Path) -> dict[str, Path]:
    """tensor name -> the safetensors file holding it (all files of the directory)."""
    index: dict[str, Path] = {}
    for path in sorted(Path(checkpoint_dir).glob("*.safetensors")):
        _, meta = _header(path)
        for key in meta:
            if key != "__metadata__":
                index[key] = path
    if not index:
        raise ValueError(
            f"{checkpoint_dir}: no *.safetensors weights (other formats are not loaded)"
        )
    return index


def _is_encoder_key(key: str) -> bool:
    return any(part in ENCODER_KEY_PARTS for part in key.split("."))


def checkpoint_id(
    checkpoint_dir: str | Path,
    is_encoder_key: Callable[[str], bool] = _is_encoder_key,
    *,
    sample_others: int = 0,
) -> str:
    """sha256 hex identity of the checkpoint (see the module doc).

    `sample_others` > 0: every other tensor contributes that many bytes from its start, middle
    and end, so a fine-tune of any part changes the id while a large checkpoint reads only a
    few KiB per tensor (the language model's identity, for KV shared across replicas)."""
    root = Path(checkpoint_dir)
    files = sorted(
        p for p in root.iterdir() if p.is_file() and p.suffix in (".json", ".jinja", ".safetensors")
    )
    stamp = (
        str(root.resolve()),
        is_encoder_key,
        sample_others,
        tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files),
    )
    if stamp in _CACHE:
        return _CACHE[stamp]
    h = hashlib.sha256()
    for path in files:
        h.update(path.name.encode() + b"\0" + str(path.stat().st_size).encode() + b"\0")
        if path.suffix != ".safetensors":
            h.update(path.read_bytes())
            continue
        raw, meta = _header(path)
        h.update(raw)
        base = 8 + len(raw)
        ranges = []
        for key, info in sorted(meta.items()):
            if key == "__metadata__":
                continue
            start, end = info["data_offsets"]
            if is_encoder_key(key):
                ranges.append((start, end))
            elif sample_others > 0:
                middle = max(start, (start + end - sample_others) // 2)
                for at in sorted({start, middle, max(start, end - sample_others)}):
                    ranges.append((at, min(at + sample_others, end)))
        ranges.sort()
        with open(path, "rb") as f:
            for start, end in ranges:
                f.seek(base + start)
                left = end - start
                while left > 0:
                    chunk = f.read(min(left, 1 << 22))
                    if not chunk:
                        raise ValueError(f"{path}: truncated tensor data")
                    h.update(chunk)
                    left -= len(chunk)
    digest = h.hexdigest()
    _CACHE[stamp] = digest
    return digest


def read_tensors(checkpoint_dir: str | Path, want: Iterable[str]) -> dict[str, torch.Tensor]:
    """Load exactly the tensors named in `want` (KeyError names the first one missing)."""
    from safetensors import safe_open

    index = safetensors_index(checkpoint_dir)
    by_file: dict[Path, list[str]] = {}
    for key in want:
        if key not in index:
            raise KeyError(f"{checkpoint_dir}: weight {key!r} not found in its safetensors files")
        by_file.setdefault(index[key], []).append(key)
    out: dict[str, torch.Tensor] = {}
    for path, keys in by_file.items():
        with safe_open(os.fspath(path), framework="pt", device="cpu") as f:
            for key in keys:
                out[key] = f.get_tensor(key)
    return out
