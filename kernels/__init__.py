"""Hot paths of the encoder, each a Triton kernel beside its torch reference.

On CUDA the Triton kernel runs; everywhere else the torch reference does (`impl=` overrides,
and `VISIONGATE_KERNELS=torch` forces the references on CUDA too).
"""

from __future__ import annotations

from kernels.gather import gather_tokens, topk_sorted
from kernels.int4 import dequantize_int4, packed_shapes, quantize_int4
from kernels.resize_patchify import ResizeCrop, resize_normalize_patchify, resize_taps

__all__ = (
    "ResizeCrop",
    "dequantize_int4",
    "gather_tokens",
    "packed_shapes",
    "quantize_int4",
    "resize_normalize_patchify",
    "resize_taps",
    "topk_sorted",
)
