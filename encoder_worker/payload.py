"""The stored form of an image's visual tokens: INT4-packed values, fp16 scales, patch positions.

`VisualTokens` is a msgspec header plus three raw byte strings. `to_bytes()` lays it out as

    b"VGT4" | u32 little-endian header length | msgpack header | packed | scales | positions

with `packed` = [N, G*group/2] uint8 (two 4-bit values per byte, see `kernels.int4`),
`scales` = [N, G] float16 little-endian and `positions` = [N] int32 little-endian.
`from_bytes()` is its exact inverse and checks everything (magic, sizes, header fields), so
bytes from a cache or a queue either come back as the same payload or raise ValueError.
Nothing is unpickled. `to_embeds()` dequantizes on the consumer's device.
"""

from __future__ import annotations

import struct

import msgspec
import torch

from kernels import dequantize_int4, packed_shapes, quantize_int4

__all__ = ("TokensHeader", "VisualTokens", "quantize_tokens", "to_embeds")

MAGIC = b"VGT4"
VERSION = 1
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
        return b"".join((MAGIC, struct.pack("<I", len(head)), head, self.packed, self.scales, self.positions))

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

    def tensors(self, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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


def to_embeds(payload: VisualTokens | bytes, device: str | torch.device = "cpu") -> torch.Tensor:
    """Dequantize on `device` -> [N, hidden] float32."""
    if not isinstance(payload, VisualTokens):
        payload = VisualTokens.from_bytes(payload)
    packed, scales, _ = payload.tensors(device)
    h = payload.header
    return dequantize_int4(packed, scales, h.hidden, h.group_size)
