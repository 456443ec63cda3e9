"""What an image not encoded yet counts as against a key's token limits (the admission
estimate): the engine's own figure, else the encoder config's bound, else the default."""

from __future__ import annotations

from encoder_worker.config import EncoderConfig
from gateway.chat.metering import IMAGE_TOKENS_ESTIMATE, image_tokens_estimate
from gateway.engine.interface import EngineCapabilities


class Encoder:
    def __init__(self, tower: str) -> None:
        self.config = EncoderConfig(tower=tower)


class Engine:
    def __init__(self, own: int = 0) -> None:
        self.capabilities = EngineCapabilities(image_tokens_estimate=own)


def test_the_encoders_bound_then_the_engines_own_figure_then_the_default(tmp_path) -> None:
    """vit-l14-336 makes 576 patch rows: the flat default (256) would count it short."""
    assert image_tokens_estimate(Engine(), Encoder("vit-l14-336")) == 576
    assert image_tokens_estimate(Engine(), Encoder("vit-b16-224")) == 196
    # an upstream engine sent image bytes names its own
    assert image_tokens_estimate(Engine(1024), Encoder("vit-l14-336")) == 1024
    assert image_tokens_estimate(Engine(), object()) == IMAGE_TOKENS_ESTIMATE  # no config
    # a tower whose files this process cannot read: the default, not a failed start
    assert image_tokens_estimate(Engine(), Encoder(str(tmp_path))) == IMAGE_TOKENS_ESTIMATE
