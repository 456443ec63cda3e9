"""`ImageParts`: a conversation's images are rendered for the replica once, not every turn."""

from __future__ import annotations

import base64
import io

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
