"""Real vision-language checkpoints, one module per family: LLaVA, SmolVLM / Idefics3, Qwen2.5-VL.

See `encoder_worker.families.family` for the contract each family implements and
`detect_family` for how a checkpoint directory is recognised by its config.
"""

from encoder_worker.families.family import (
    FAMILIES,
    FamilyOutput,
    UnsupportedCheckpoint,
    VisionFamily,
    detect_family,
    load_family,
)

__all__ = (
    "FAMILIES",
    "FamilyOutput",
    "UnsupportedCheckpoint",
    "VisionFamily",
    "detect_family",
    "load_family",
)
