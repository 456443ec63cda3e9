"""`ImageParts`: a conversation's images are rendered for the replica once, not every turn."""

from __future__ import annotations

import base64
import io

import pytest
import torch

from gateway.engine.interface import (
    GenerationRequest,
    ImageInput,
    Message,
    SamplingParams,
)
from gateway.engine.upstream.wire import ImageParts


def image(name: str, rows: int = 4) -> ImageInput:
    return ImageInput(f"fp:{name}", torch.arange(rows * 8, dtype=torch.float32).view(rows, 8))


def request(*images: ImageInput) -> GenerationRequest:
    return GenerationRequest(
        request_id="r",
        messages=[Message("user", [*images, "what is this?"])],
        sampling=SamplingParams(max_output_tokens=1),
    )


def test_an_image_is_rendered_once_and_its_part_reused() -> None:
    parts = ImageParts()
    photo = image("a")
    turn = request(photo)
    assert parts.missing_bytes(turn) == photo.embeds.nbytes
    first = parts.get(photo, "embeds")
    loaded = torch.load(io.BytesIO(base64.b64decode(first["image_embeds"])), weights_only=True)
    assert torch.equal(loaded, photo.embeds)
    assert parts.missing_bytes(turn) == 0
    # the next turn's copy of the image (same content id, a new tensor) gets the same part
    again = ImageInput(photo.digest, photo.embeds.clone())
    assert parts.get(again, "embeds") is first


def test_least_recently_used_parts_leave_past_the_budget() -> None:
    a, b, c = image("a"), image("b"), image("c")
    size = len(ImageParts().get(a, "embeds")["image_embeds"])
    parts = ImageParts(budget=2 * size)
    part_a = parts.get(a, "embeds")
    parts.get(b, "embeds")
    assert parts.get(a, "embeds") is part_a  # a used last: b is the oldest now
    parts.get(c, "embeds")
    assert parts.missing_bytes(request(a, c)) == 0
    assert parts.missing_bytes(request(b)) == b.embeds.nbytes
    too_big = ImageParts(budget=size - 1)
    too_big.get(a, "embeds")
    assert too_big.missing_bytes(request(a)) == a.embeds.nbytes  # rendered, not kept


def test_lazy_tokens_are_decoded_once_and_not_at_all_for_a_rendered_part() -> None:
    """A conversation's next turn carries its photo's tokens undecoded: the replica's part is
    rendered already, so nothing decodes them again (the first turn decoded them once)."""
    decoded: list[str] = []
    tokens = torch.arange(32, dtype=torch.float32).view(4, 8)

    def lazy(name: str) -> ImageInput:
        def decode() -> torch.Tensor:
            decoded.append(name)
            return tokens.clone()

        return ImageInput(f"fp:{name}", decode=decode, rows=4, hidden=8)

    parts = ImageParts()
    first_turn = lazy("a")
    assert first_turn.has_embeds and first_turn.num_tokens == 4 and not decoded
    assert parts.missing_bytes(request(first_turn)) == tokens.nbytes and not decoded
    part = parts.get(first_turn, "embeds")
    assert decoded == ["a"]
    assert first_turn.embeds is first_turn.embeds  # kept once decoded
    assert decoded == ["a"]
    next_turn = lazy("a")
    assert parts.missing_bytes(request(next_turn)) == 0
    assert parts.get(next_turn, "embeds") is part
    assert decoded == ["a"]  # the next turn's tokens were never decoded


def test_lazy_tokens_of_another_shape_than_stored_are_refused() -> None:
    wrong = ImageInput("fp:x", decode=lambda: torch.zeros(3, 8), rows=4, hidden=8)
    with pytest.raises(ValueError, match=r"\(3, 8\).*\(4, 8\)"):
        _ = wrong.embeds
    with pytest.raises(ValueError, match="lazy visual tokens"):
        ImageInput("fp:y", torch.zeros(4, 8), decode=lambda: torch.zeros(4, 8), rows=4, hidden=8)
