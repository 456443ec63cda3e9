"""The stored form of an image's visual tokens: INT4-packed values, fp16 scales, patch positions.

`VisualTokens` is a msgspec header plus three raw byte strings. `to_bytes()` lays it out as

    b"VGT4" | u32 little-endian header length | msgpack header | packed | scales | positions

with `packed` = [N, G*group/2] uint8 (two 4-bit values per byte, see `visiongate_kernels.int4`),
`scales` = [N, G] float16 little-endian and `positions` = [N] int32 little-endian.
`from_bytes()` is its exact inverse and checks everything (magic, sizes, header fields), so
bytes from a cache or a queue either come back as the same payload or raise ValueError.
Nothing is unpickled. `to_embeds()` dequantizes on the consumer's device.

`FloatTokens` is the unquantized form (real VLM checkpoints in exact mode, or bf16 to halve the
bytes): `b"VGTF" | u32 header length | msgpack FloatHeader | values | positions` with `values` =
[N, hidden] float32 or bfloat16 little-endian. Same strictness in `from_bytes`.
`payload_from_bytes()` reads either form by its magic.
"""

from __future__ import annotations

import struct

import msgspec
import torch

from visiongate_kernels.int4 import dequantize_int4, packed_shapes, quantize_int4

__all__ = (
    "FLOAT_DTYPES",
    "FloatHeader",
    "FloatTokens",
    "TokensHeader",
    "VisualTokens",
    "float_tokens",
    "payload_from_bytes",
    "quantize_tokens",
    "to_embeds",
)

MAGIC = b"VGT4"
FLOAT_MAGIC = b"VGTF"
VERSION = 1
# stored dtype name -> (torch dtype, bytes per value)
FLOAT_DTYPES = {"fp32": ("float32", 4), "bf16": ("bfloat16", 2)}
_MAX_TOKENS = 1 << 20
_MAX_HIDDEN = 1 << 16


class TokensHeader(msgspec.Struct, frozen=True, array_like=True):
    version: int
    n_tokens: int  # tokens stored (dominant + contextual)
    hidden: int
    group_size: int
    tokens_total: int  # patch tokens before dropping
    n_contextual: int = 0  # trailing tokens that are merges of dropped ones


_ENCODER = msgspec.msgpack.Encoder()
_HEADER_DECODER = msgspec.msgpack.Decoder(TokensHeader)


class VisualTokens(msgspec.Struct, frozen=True):
    header: TokensHeader
    packed: bytes  # [N, G*group/2] uint8
    scales: bytes  # [N, G] float16 LE
    positions: bytes  # [N] int32 LE

    @property
    def nbytes(self) -> int:
        return len(self.packed) + len(self.scales) + len(self.positions)

    def to_bytes(self) -> bytes:
        head = _ENCODER.encode(self.header)
        return b"".join(
            (MAGIC, struct.pack("<I", len(head)), head, self.packed, self.scales, self.positions)
        )

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> VisualTokens:
        data = bytes(data)
        if len(data) < 8 or data[:4] != MAGIC:
            raise ValueError("not a visual-tokens payload (bad magic)")
        (head_len,) = struct.unpack_from("<I", data, 4)
        if head_len > len(data) - 8:
            raise ValueError("truncated visual-tokens payload (header)")
        try:
            header = _HEADER_DECODER.decode(data[8 : 8 + head_len])
        except msgspec.DecodeError as exc:
            raise ValueError(f"bad visual-tokens header: {exc}") from None
        _check_header(header)
        (n, nbytes), (_, groups) = packed_shapes(header.n_tokens, header.hidden, header.group_size)
        sizes = (n * nbytes, n * groups * 2, n * 4)
        body = data[8 + head_len :]
        if len(body) != sum(sizes):
            raise ValueError(f"visual-tokens body is {len(body)} bytes, expected {sum(sizes)}")
        a, b = sizes[0], sizes[0] + sizes[1]
        return cls(header, body[:a], body[a:b], body[b:])

    def tensors(
        self, device: str | torch.device = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(packed [N, B] uint8, scales [N, G] fp16, positions [N] int64) on `device`."""
        h = self.header
        (n, nbytes), (_, groups) = packed_shapes(h.n_tokens, h.hidden, h.group_size)
        if n == 0:
            return (
                torch.empty(0, nbytes, dtype=torch.uint8, device=device),
                torch.empty(0, groups, dtype=torch.float16, device=device),
                torch.empty(0, dtype=torch.long, device=device),
            )
        packed = torch.frombuffer(bytearray(self.packed), dtype=torch.uint8).view(n, nbytes)
        scales = torch.frombuffer(bytearray(self.scales), dtype=torch.float16).view(n, groups)
        positions = torch.frombuffer(bytearray(self.positions), dtype=torch.int32).long()
        return packed.to(device), scales.to(device), positions.to(device)

    def positions_list(self) -> list[int]:
        return self.tensors()[2].tolist()


def _check_header(h: TokensHeader) -> None:
    if h.version != VERSION:
        raise ValueError(f"unsupported visual-tokens version {h.version}")
    g = h.group_size
    if g < 2 or g & (g - 1) or g > 1024:
        raise ValueError(f"bad group size {g}")
    if not 0 <= h.n_tokens <= _MAX_TOKENS or not 0 < h.hidden <= _MAX_HIDDEN:
        raise ValueError(f"bad token shape {h.n_tokens}x{h.hidden}")
    if not 0 <= h.n_contextual <= h.n_tokens or h.tokens_total < 0:
        raise ValueError("bad token counts in header")


def quantize_tokens(
    tokens: torch.Tensor,  # [N, hidden] float
    positions: torch.Tensor,  # [N] int
    tokens_total: int,
    group_size: int,
    n_contextual: int = 0,
) -> VisualTokens:
    """INT4-quantize tokens on their device and pack them into a `VisualTokens`."""
    n, hidden = tokens.shape
    packed, scales = quantize_int4(tokens.float(), group_size)
    header = TokensHeader(VERSION, n, hidden, group_size, tokens_total, n_contextual)
    return VisualTokens(
        header,
        packed.cpu().numpy().tobytes(),
        scales.cpu().numpy().astype("<f2").tobytes(),
        positions.to(torch.int32).cpu().numpy().astype("<i4").tobytes(),
    )


class FloatHeader(msgspec.Struct, frozen=True, array_like=True):
    version: int
    n_tokens: int
    hidden: int
    dtype: str  # "fp32" | "bf16"
    tokens_total: int  # rows before patch dropping
    n_contextual: int = 0  # trailing tokens that are merges of dropped ones


_FLOAT_HEADER_DECODER = msgspec.msgpack.Decoder(FloatHeader)


class FloatTokens(msgspec.Struct, frozen=True):
    header: FloatHeader
    values: bytes  # [N, hidden] float32 / bfloat16 LE
    positions: bytes  # [N] int32 LE (row index before dropping)

    @property
    def nbytes(self) -> int:
        return len(self.values) + len(self.positions)

    def to_bytes(self) -> bytes:
        head = _ENCODER.encode(self.header)
        return b"".join(
            (FLOAT_MAGIC, struct.pack("<I", len(head)), head, self.values, self.positions)
        )

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> FloatTokens:
        data = bytes(data)
        if len(data) < 8 or data[:4] != FLOAT_MAGIC:
            raise ValueError("not a float visual-tokens payload (bad magic)")
        (head_len,) = struct.unpack_from("<I", data, 4)
        if head_len > len(data) - 8:
            raise ValueError("truncated float visual-tokens payload (header)")
        try:
            h = _FLOAT_HEADER_DECODER.decode(data[8 : 8 + head_len])
        except msgspec.DecodeError as exc:
            raise ValueError(f"bad float visual-tokens header: {exc}") from None
        if h.version != VERSION:
            raise ValueError(f"unsupported visual-tokens version {h.version}")
        if h.dtype not in FLOAT_DTYPES:
            raise ValueError(f"bad stored dtype {h.dtype!r}")
        if not 0 <= h.n_tokens <= _MAX_TOKENS or not 0 < h.hidden <= _MAX_HIDDEN:
            raise ValueError(f"bad token shape {h.n_tokens}x{h.hidden}")
        if not 0 <= h.n_contextual <= h.n_tokens or h.tokens_total < 0:
            raise ValueError("bad token counts in header")
        n_values = h.n_tokens * h.hidden * FLOAT_DTYPES[h.dtype][1]
        body = data[8 + head_len :]
        if len(body) != n_values + h.n_tokens * 4:
            raise ValueError(
                f"float visual-tokens body is {len(body)} bytes, expected "
                f"{n_values + h.n_tokens * 4}"
            )
        return cls(h, body[:n_values], body[n_values:])

    def tensors(self, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """(values [N, hidden] in the stored dtype, positions [N] int64) on `device`."""
        h = self.header
        dtype = getattr(torch, FLOAT_DTYPES[h.dtype][0])
        if h.n_tokens == 0:
            return (
                torch.empty(0, h.hidden, dtype=dtype, device=device),
                torch.empty(0, dtype=torch.long, device=device),
            )
        values = torch.frombuffer(bytearray(self.values), dtype=dtype).view(h.n_tokens, h.hidden)
        positions = torch.frombuffer(bytearray(self.positions), dtype=torch.int32).long()
        return values.to(device), positions.to(device)

    def positions_list(self) -> list[int]:
        return self.tensors()[1].tolist()


def float_tokens(
    tokens: torch.Tensor,  # [N, hidden] float
    positions: torch.Tensor,  # [N] int
    tokens_total: int,
    dtype: str,
    n_contextual: int = 0,
) -> FloatTokens:
    """Store tokens unquantized as float32 ("fp32", exact) or bfloat16 ("bf16")."""
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype must be one of {tuple(FLOAT_DTYPES)}, got {dtype!r}")
    n, hidden = tokens.shape
    values = tokens.detach().to("cpu", getattr(torch, FLOAT_DTYPES[dtype][0])).contiguous()
    raw = values.view(torch.int16 if dtype == "bf16" else torch.int32).numpy()
    return FloatTokens(
        FloatHeader(VERSION, n, hidden, dtype, tokens_total, n_contextual),
        raw.astype(raw.dtype.newbyteorder("<")).tobytes(),
        positions.to(torch.int32).cpu().numpy().astype("<i4").tobytes(),
    )


def payload_from_bytes(data: bytes | bytearray | memoryview) -> VisualTokens | FloatTokens:
    """Either stored form, told apart by its magic; ValueError on anything else."""
    head = bytes(data[:4])
    if head == FLOAT_MAGIC:
        return FloatTokens.from_bytes(data)
    return VisualTokens.from_bytes(data)


def to_embeds(
    payload: VisualTokens | FloatTokens | bytes, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """Dequantize (or widen) on `device` -> [N, hidden] float32."""
    if not isinstance(payload, (VisualTokens, FloatTokens)):
        payload = payload_from_bytes(payload)
    if isinstance(payload, FloatTokens):
        return payload.tensors(device)[0].float()
    packed, scales, _ = payload.tensors(device)
    h = payload.header
    return dequantize_int4(packed, scales, h.hidden, h.group_size)
