"""What travels between gateways and encoder workers through Redis: jobs and their results.

The keys they travel under and the vision-cache entry a worker writes are in `storage.py`.
A job carries no image bytes and no tensors: a digest, the fingerprint the caller expects, and
what the worker must agree with to produce it. Results say only how the job ended; the tokens
are read from the vision cache (`storage.pack_encoded`: the payload in its INT4 or float form
and, for a real VLM checkpoint, the image's `ImageLayout`), so the layout travels with the
tokens.

For a VLM checkpoint the fingerprint comes from the checkpoint alone (`hidden_size` is its
language model's, `target_rms` is None): its projector is real, nothing is rescaled.
"""

from __future__ import annotations

import msgspec

__all__ = (
    "IMAGE_ERROR_CODES",
    "EncodeDone",
    "EncodeFailed",
    "EncodeJob",
    "EncodeResult",
    "decode_job",
    "decode_result",
    "encode_job",
    "encode_result",
)

# ImageError codes: the caller's image is bad; never retried, never dead-lettered
IMAGE_ERROR_CODES = ("invalid_image", "image_too_large", "unsupported_image_format")


class EncodeJob(msgspec.Struct, frozen=True, array_like=True):
    """One image to encode. `attempt` counts earlier runs of this job that failed with an
    unexpected error (the worker re-enqueues it with `attempt + 1`); runs lost to a dead worker
    are counted by the stream's delivery counter instead."""

    job_id: str  # uuid4 hex; names the result key
    digest: str  # sha256 hex of the image bytes, stored under storage.image_key(digest)
    fingerprint: str  # the encoder fingerprint the caller will read the tokens under
    hidden_size: int  # the caller's LM hidden size ...
    target_rms: float | None  # ... and embedding RMS: a worker built for others refuses the job
    # W3C traceparent of the caller's span: the worker's spans become its children
    traceparent: str | None
    enqueued_ns: int  # time.time_ns() when the caller enqueued it
    attempt: int = 0


class EncodeDone(msgspec.Struct, frozen=True, array_like=True, tag="done"):
    """The tokens are in the vision cache under (job.fingerprint, job.digest)."""

    job_id: str
    consumer: str  # the worker that encoded it
    tokens_kept: int


class EncodeFailed(msgspec.Struct, frozen=True, array_like=True, tag="failed"):
    """`code` is an ImageError code (the image is bad) or `dead_letter` (the job was given up;
    `message` says why, as in vg:encode:dead)."""

    job_id: str
    code: str
    message: str


EncodeResult = EncodeDone | EncodeFailed

_encoder = msgspec.msgpack.Encoder()
_job_decoder = msgspec.msgpack.Decoder(EncodeJob)
_result_decoder = msgspec.msgpack.Decoder(EncodeResult)


def encode_job(job: EncodeJob) -> bytes:
    return _encoder.encode(job)


def decode_job(data: bytes) -> EncodeJob:
    """msgpack -> EncodeJob; msgspec.DecodeError / ValidationError on anything malformed."""
    return _job_decoder.decode(data)


def encode_result(result: EncodeResult) -> bytes:
    return _encoder.encode(result)


def decode_result(data: bytes) -> EncodeResult:
    return _result_decoder.decode(data)
