"""The servers `bench.streaming` compares, each run as `python -m bench._streaming_servers`.

    python -m bench._streaming_servers gateway --port P [--profile STATS]
    python -m bench._streaming_servers raw --ws-port P1 --sse-port P2 --frames FILE --deltas N
        [--burst]

`gateway`: the real gateway (Litestar on uvicorn, `gateway.server.runner.serve`, its default
settings: telemetry, metrics and the JSON access log on) over `gateway.testing.fakes.FakeEngine`,
which echoes the prompt's words one delta each with nothing between them, so everything a
response costs is the gateway's own.

`raw`: the same events from servers with nothing in between: a `websockets` server for
Realtime and a plain asyncio HTTP/1.1 server for Chat Completions SSE (chunked transfer, as
uvicorn sends a stream). FILE holds one response's frames as the gateway sent them (captured
by the benchmark): the raw servers send those frames, in that order, re-encoding each text
delta (its `event_id` and text, or its chunk's content) with msgspec per delta, as a minimal
server would build them, and the other frames as captured. They answer every request with
`--deltas` text deltas, whatever it asks. Between two deltas they let the event loop turn once,
as the gateway's null engine does (tokens come from somewhere, one at a time); `--burst` sends
a response's deltas back to back instead, the strictest baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

import msgspec

__all__ = ("main",)

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.decode


def _pieces(n: int) -> list[str]:
    """The text of `n` deltas, the sizes of the words the benchmark's prompt has."""
    return [f"w{i:03d}" if i == 0 else f" w{i:03d}" for i in range(n)]


# ------------------------------------------------------------------ Realtime (websockets)


class RawRealtime:
    """A `websockets` handler: `session.created` on connect, then a response's frames for every
    `response.create`."""

    def __init__(self, frames: list[str], deltas: int, burst: bool) -> None:
        self.burst = burst
        self.created = next(f for f in frames if '"session.created"' in f)
        response = [f for f in frames if f is not self.created]
        first = next(i for i, f in enumerate(response) if '"response.output_text.delta"' in f)
        last = max(i for i, f in enumerate(response) if '"response.output_text.delta"' in f)
        self.before = response[:first]
        self.after = response[last + 1 :]
        self.delta = _decode(response[first])
        self.pieces = _pieces(deltas)

    async def __call__(self, socket: Any) -> None:
        seq = 0
        await socket.send(self.created)
        async for message in socket:
            if '"response.create"' not in message:
                continue
            for frame in self.before:
                await socket.send(frame)
            delta = dict(self.delta)
            for piece in self.pieces:
                seq += 1
                delta["event_id"] = f"event_{seq:06d}"
                delta["delta"] = piece
                await socket.send(_encode(delta), text=True)
                if not self.burst:
                    await asyncio.sleep(0)  # one loop turn a delta, as the null engine takes
            for frame in self.after:
                await socket.send(frame)


# ------------------------------------------------------------------ SSE (plain asyncio HTTP)

_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
    b"cache-control: no-cache\r\nx-accel-buffering: no\r\ntransfer-encoding: chunked\r\n\r\n"
)


def _chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class RawSSE:
    """A keep-alive HTTP/1.1 server answering every POST with one completion's SSE frames."""

    def __init__(self, frames: list[str], deltas: int, burst: bool) -> None:
        self.burst = burst
        data = [f.encode() for f in frames]
        content = [i for i, f in enumerate(frames) if '"content":"' in f and '"role"' not in f]
        first, last = content[0], content[-1]
        self.before = data[:first]
        self.after = data[last + 1 :]
        self.chunk = _decode(frames[first].removeprefix("data: "))
        self.pieces = _pieces(deltas)

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                writer.write(_HEAD)
                for frame in self.before:
                    writer.write(_chunked(frame))
                    await writer.drain()
                chunk = dict(self.chunk)
                choice = dict(chunk["choices"][0])
                chunk["choices"] = [choice]
                for piece in self.pieces:
                    choice["delta"] = {"content": piece}
                    writer.write(_chunked(b"data: " + _encode(chunk) + b"\n\n"))
                    await writer.drain()
                    if not self.burst:
                        await asyncio.sleep(0)
                for frame in self.after:
                    writer.write(_chunked(frame))
                    await writer.drain()
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def _serve_raw(
    ws_port: int, sse_port: int, frames: dict[str, list[str]], n: int, burst: bool
) -> None:
    from websockets.asyncio.server import serve

    sse = await asyncio.start_server(RawSSE(frames["sse"], n, burst), "127.0.0.1", sse_port)
    realtime = RawRealtime(frames["realtime"], n, burst)
    async with serve(realtime, "127.0.0.1", ws_port, max_size=None, compression=None), sse:
        await asyncio.Future()


def _serve_gateway(port: int, profile: Path | None) -> None:
    from gateway.server.app import create_app
    from gateway.server.runner import serve
    from gateway.settings import Settings
    from gateway.testing.fakes import FakeEncoder, FakeEngine

    settings = Settings.load(
        {"host": "127.0.0.1", "port": port, "max_output_tokens": 2048}, environ={}
    )
    app = create_app(settings, engine=FakeEngine(), encoder=FakeEncoder())
    if profile is None:
        serve(app, settings)
        return
    import cProfile

    profiler = cProfile.Profile()
    try:
        # until SIGINT: uvicorn stops gracefully, then raises it again (KeyboardInterrupt)
        profiler.runcall(serve, app, settings)
    except KeyboardInterrupt:
        pass
    finally:
        profiler.dump_stats(profile)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench._streaming_servers")
    sub = parser.add_subparsers(dest="kind", required=True)
    gw = sub.add_parser("gateway")
    gw.add_argument("--port", type=int, required=True)
    gw.add_argument("--profile", type=Path, help="run under cProfile, its stats written here")
    raw = sub.add_parser("raw")
    raw.add_argument("--ws-port", type=int, required=True)
    raw.add_argument("--sse-port", type=int, required=True)
    raw.add_argument("--frames", type=Path, required=True)
    raw.add_argument("--deltas", type=int, required=True)
    raw.add_argument("--burst", action="store_true", help="no loop turn between deltas")
    args = parser.parse_args(argv)
    if args.kind == "gateway":
        _serve_gateway(args.port, args.profile)
    else:
        frames = json.loads(args.frames.read_text())
        asyncio.run(_serve_raw(args.ws_port, args.sse_port, frames, args.deltas, args.burst))


if __name__ == "__main__":
    main()
