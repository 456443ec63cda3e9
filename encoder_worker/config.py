"""Encoder configuration: one frozen msgspec Struct, validated on construction.

`tower` may name a real VLM checkpoint directory (LLaVA, SmolVLM / Idefics3, Qwen2.5-VL,
recognised by its config.json `model_type`): the encoder then runs that checkpoint's own
preprocessing, vision tower and projector (`EncoderConfig.family` says which).
"""

from __future__ import annotations

import os

import msgspec

__all__ = (
    "PRUNING_MODES",
    "SYNTHETIC_TOWERS",
    "VISUAL_TOKEN_FORMS",
    "EncoderConfig",
    "tower_family",
)

PRUNING_MODES = ("none", "random", "topk", "dynamic", "dynamic+merge")
SYNTHETIC_TOWERS = ("vit-b16-224", "vit-l14-336")
VISUAL_TOKEN_FORMS = ("int4", "bf16", "fp32")
_DEVICES = ("auto", "cpu", "cuda")


def tower_family(tower: str) -> str | None:
    """The VLM family of a checkpoint directory ("llava", "idefics3", "qwen2_5_vl"), or None
    for a synthetic tower name or a vision-only (CLIP / SigLIP) checkpoint.

    Raises `UnsupportedCheckpoint` (a ValueError naming the supported families) for a
    directory whose config describes a vision-language model of another family."""
    if tower in SYNTHETIC_TOWERS or not os.path.isdir(tower):
        return None
    from encoder_worker.families.family import (
        FAMILIES,
        UnsupportedCheckpoint,
        detect_family,
        read_config,
    )

    try:
        family = detect_family(tower)
        config = read_config(tower)
    except UnsupportedCheckpoint:
        return None
    dual_encoder = config.get("model_type") in ("clip", "siglip")  # vision towers, not VLMs
    if (
        family is None
        and not dual_encoder
        and "vision_config" in config
        and "text_config" in config
    ):
        raise UnsupportedCheckpoint(
            f"{tower}: model_type {config.get('model_type')!r} is not a supported vision-language "
            f"family (supported: {', '.join(sorted(FAMILIES))})"
        )
    return family


_DTYPES = ("auto", "float32", "float16", "bfloat16")


class EncoderConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How images become visual tokens. Every field that changes the tokens feeds the fingerprint.

    tower: "vit-b16-224" / "vit-l14-336" (seeded synthetic CLIP towers of those shapes), the
        path of a local CLIP / SigLIP vision checkpoint directory (safetensors), or the path of
        a VLM checkpoint (its own vision tower and projector; `feature_layer` is then the
        checkpoint's and this field is ignored).
    feature_layer: hidden state the features come from, as in `hidden_states[feature_layer]`
        (-2: the penultimate layer, LLaVA's choice). Layers after it are not run.
    pruning: "none" | "random" | "topk" | "dynamic" | "dynamic+merge".
    keep_ratio: fraction of patch tokens kept by "random" and "topk".
    min_keep_ratio / max_keep_ratio: clamp of the "dynamic" keep ratio.
    saliency_mass: "dynamic" keeps the fewest tokens holding this share of the saliency.
    merge_tokens: contextual tokens "dynamic+merge" builds from the dropped ones.
    int4_group_size: values per fp16 scale in the INT4 payload (power of two, 16..256).
    visual_tokens: stored form of the tokens: "int4" (group-wise, the default), "bf16" or
        "fp32" (unquantized; with pruning "none" on a VLM checkpoint this is exact mode: the
        rows are the checkpoint's own `get_image_features`).
    device / dtype: "auto" = CUDA with bf16 (fp16 if bf16 is unsupported) when present, else
        CPU with float32.
    compile: torch.compile the tower (CUDA only), batches padded to fixed shapes.
    max_image_bytes / max_pixels: refused before decoding (`image_too_large`).
    max_batch / max_wait_ms: micro-batching of concurrent `encode` calls.
    cpu_batch: the batch limit on a CPU, where the tower runs image by image anyway: a bigger
        batch buys nothing there and makes an image that arrives while it runs wait for all of
        it (default 1).
    decode_threads: Pillow decodes run on this many threads (Pillow releases the GIL).
    """

    tower: str = "vit-b16-224"
    feature_layer: int = -2
    pruning: str = "dynamic"
    keep_ratio: float = 0.25
    min_keep_ratio: float = 0.1
    max_keep_ratio: float = 0.5
    saliency_mass: float = 0.5
    merge_tokens: int = 8
    int4_group_size: int = 64
    visual_tokens: str = "int4"
    device: str = "auto"
    dtype: str = "auto"
    compile: bool = False
    seed: int = 0
    max_image_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 40_000_000
    max_batch: int = 8
    cpu_batch: int = 1
    max_wait_ms: float = 5.0
    decode_threads: int = 2

    def __post_init__(self) -> None:
        if self.tower not in SYNTHETIC_TOWERS and not os.path.isdir(self.tower):
            raise ValueError(
                f"tower must be one of {SYNTHETIC_TOWERS} or a checkpoint directory, "
                f"got {self.tower!r}"
            )
        if self.feature_layer == 0:
            raise ValueError(
                "feature_layer 0 is the patch embedding; use a layer index >= 1 or < 0"
            )
        if self.pruning not in PRUNING_MODES:
            raise ValueError(f"pruning must be one of {PRUNING_MODES}, got {self.pruning!r}")
        for name in ("keep_ratio", "min_keep_ratio", "max_keep_ratio", "saliency_mass"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {value}")
        if self.min_keep_ratio > self.max_keep_ratio:
            raise ValueError(
                f"min_keep_ratio ({self.min_keep_ratio}) > max_keep_ratio ({self.max_keep_ratio})"
            )
        if self.merge_tokens < 0:
            raise ValueError(f"merge_tokens must be >= 0, got {self.merge_tokens}")
        g = self.int4_group_size
        if g < 16 or g > 256 or g & (g - 1):
            raise ValueError(f"int4_group_size must be a power of two in [16, 256], got {g}")
        if self.visual_tokens not in VISUAL_TOKEN_FORMS:
            raise ValueError(
                f"visual_tokens must be one of {VISUAL_TOKEN_FORMS}, got {self.visual_tokens!r}"
            )
        if self.device not in _DEVICES and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be one of {_DEVICES} or 'cuda:N', got {self.device!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.max_image_bytes <= 0 or self.max_pixels <= 0:
            raise ValueError("max_image_bytes and max_pixels must be positive")
        if self.max_batch < 1 or self.cpu_batch < 1:
            raise ValueError(
                f"max_batch and cpu_batch must be >= 1, got {self.max_batch}, {self.cpu_batch}"
            )
        if self.max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {self.max_wait_ms}")
        if self.decode_threads < 1:
            raise ValueError(f"decode_threads must be >= 1, got {self.decode_threads}")

    @property
    def family(self) -> str | None:
        """The VLM family when `tower` is a VLM checkpoint directory, else None."""
        return tower_family(self.tower)

    @property
    def max_image_tokens(self) -> int:
        """The most visual tokens one image becomes under this config, from the tower's files
        alone (no weights loaded): a VLM checkpoint's bound (`families.max_image_tokens`),
        else the tower's patches. Patch dropping only ever keeps fewer."""
        if self.family is not None:
            from encoder_worker.families.family import max_image_tokens

            return max_image_tokens(self.tower, max_pixels=self.max_pixels)
        from encoder_worker.tower import tower_grid

        return tower_grid(self.tower) ** 2

    @property
    def exact(self) -> bool:
        """No patch dropping and unquantized fp32 tokens: the checkpoint's rows as they are."""
        return self.pruning == "none" and self.visual_tokens == "fp32"
