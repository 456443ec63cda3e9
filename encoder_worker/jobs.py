"""What travels between gateways and encoder workers through Redis: jobs, their results, and
the encoder configuration a gateway publishes for its workers (`EncoderSpec`).

The keys they travel under and the vision-cache entry a worker writes are in `storage.py`.
A job carries no image bytes and no tensors: a digest, the fingerprint the caller expects, and
what the worker must agree with to produce it. Results say only how the job ended; the tokens
are read from the vision cache (`storage.pack_encoded`: the payload in its INT4 or float form
and, for a real VLM checkpoint, the image's `ImageLayout`), so the layout travels with the
tokens.

For a VLM checkpoint the fingerprint comes from the checkpoint alone (`hidden_size` is its
language model's, `target_rms` is None): its projector is real, nothing is rescaled.

A gateway publishes its `EncoderSpec` as versioned JSON: the `EncoderConfig` fields that shape
the tokens (and bound the images), its language model's hidden size, the RMS of its embedding
rows as the engine measures it in the dtype it runs, and the fingerprint these make. A worker
takes all of it from there, so nothing that must agree is copied by hand; the fingerprint lets
it check that it reproduces the gateway's encoder exactly before it serves a job.
"""

from __future__ import annotations

import msgspec

from encoder_worker.config import EncoderConfig

__all__ = (
    "ENCODER_MISMATCH",
    "IMAGE_ERROR_CODES",
    "SPEC_VERSION",
    "EncodeDone",
    "EncodeFailed",
    "EncodeJob",
    "EncodeResult",
    "EncoderShape",
    "EncoderSpec",
    "decode_job",
    "decode_result",
    "decode_spec",
    "encode_job",
    "encode_result",
    "encode_spec",
    "make_spec",
    "spec_config",
)

# ImageError codes: the caller's image is bad; never retried, never dead-lettered
IMAGE_ERROR_CODES = ("invalid_image", "image_too_large", "unsupported_image_format")
# the job asks for an encoder no worker of the deployment serves (its gateway was replaced by
# one with another configuration, or runs other settings than its peers)
ENCODER_MISMATCH = "encoder_mismatch"


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
    """`code` is an ImageError code (the image is bad), `encoder_mismatch` (no worker serves
    the job's fingerprint) or `dead_letter` (the job was given up); `message` says why, as in
    vg:encode:dead."""

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


# -- the encoder configuration a gateway publishes ---------------------------------------------

SPEC_VERSION = 1


class EncoderShape(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The `EncoderConfig` fields a worker takes from its gateway: all that shape the tokens,
    and the image limits. Device, dtype, compilation and batching stay the worker's own."""

    tower: str
    feature_layer: int
    pruning: str
    keep_ratio: float
    min_keep_ratio: float
    max_keep_ratio: float
    saliency_mass: float
    merge_tokens: int
    int4_group_size: int
    visual_tokens: str
    seed: int
    max_image_bytes: int
    max_pixels: int


class EncoderSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What a gateway encodes with (`storage.spec_key(fingerprint)`). `target_rms` is None for
    a VLM checkpoint (its projector is real) or when the gateway does not rescale."""

    version: int = SPEC_VERSION
    fingerprint: str
    hidden_size: int | None
    target_rms: float | None
    encoder: EncoderShape
    published_at: float = 0.0  # time.time() of the gateway that wrote it


class _Version(msgspec.Struct):
    version: int


_spec_encoder = msgspec.json.Encoder()
_spec_decoder = msgspec.json.Decoder(EncoderSpec)
_version_decoder = msgspec.json.Decoder(_Version)


def make_spec(
    config: EncoderConfig,
    hidden_size: int | None,
    target_rms: float | None,
    fingerprint: str,
    published_at: float = 0.0,
) -> EncoderSpec:
    shape = {f: getattr(config, f) for f in EncoderShape.__struct_fields__}
    return EncoderSpec(
        fingerprint=fingerprint,
        hidden_size=hidden_size,
        target_rms=target_rms,
        encoder=EncoderShape(**shape),
        published_at=published_at,
    )


def spec_config(spec: EncoderSpec, base: EncoderConfig, **overrides: object) -> EncoderConfig:
    """`base` (the worker's own device, batching...) with the spec's shaping fields, then
    `overrides` (a worker's explicit flags); ValueError if the result is not a valid config."""
    fields = msgspec.structs.asdict(spec.encoder)
    fields.update(overrides)
    return msgspec.structs.replace(base, **fields)


def encode_spec(spec: EncoderSpec) -> bytes:
    return _spec_encoder.encode(spec)


def decode_spec(data: bytes) -> EncoderSpec:
    """JSON -> EncoderSpec; ValueError naming what is wrong (another version included)."""
    try:
        version = _version_decoder.decode(data).version
    except msgspec.MsgspecError as exc:
        raise ValueError(f"not an encoder spec: {exc}") from None
    if version != SPEC_VERSION:
        raise ValueError(
            f"the gateway publishes encoder spec version {version}, this worker reads version "
            f"{SPEC_VERSION}: run the same visiongate release on gateways and workers"
        )
    try:
        return _spec_decoder.decode(data)
    except msgspec.MsgspecError as exc:
        raise ValueError(f"malformed encoder spec: {exc}") from None
