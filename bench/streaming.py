"""Streaming benchmark: the gateway's own cost a delta, against raw servers sending the same events.

    python -m bench.streaming --out DIR                 # ~2 min on a 2-core CPU; DIR/streaming.json
    python -m bench.streaming --out DIR --quick         # one round of short points

The gateway runs in a child process over `gateway.testing.fakes.FakeEngine` (a null engine: it
answers the prompt's words, one text delta each, as fast as the loop turns), with its default
settings (`bench._streaming_servers`). Its first Realtime response and first streamed chat
completion are captured, and a second child process serves those frames from raw servers: a
`websockets` server (Realtime) and a plain asyncio HTTP/1.1 server (Chat Completions SSE), each
building every text delta with msgspec as it sends it. Both are asked the same thing, by the
same clients, in this process:
- Realtime: one `websockets` connection a client, `response.create` (out of band, with the
  `--deltas - 1` words as its input) after `response.done`, again and again;
- SSE: one `httpx` connection a client, `POST /v1/chat/completions` with `stream: true` and the
  same words, the next one after `data: [DONE]`.
Each point runs `--clients` (1 and 50) clients for `--seconds`, after a warm-up; raw and
gateway run back to back and swap order every round (`--rounds`), so machine drift hits both
alike. Per point: messages/s (every frame or SSE event a client received inside the window),
responses/s and p50/p95 of a response (request sent -> its last frame). Printed per point and
as ratios (gateway / raw messages/s; gateway - raw p50 in ms), medians over the rounds; the goal
is >= 0.9x messages/s and <= +1 ms p50. The run fails if the two sides ever send a different
number of messages for a response.

`--profile` runs the gateway under cProfile instead of measuring: DIR/streaming_profile.txt.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import structlog

from bench._load_report import machine_info
from bench._load_stats import percentile, write_json
from bench._outcome import RunOutcome
from gateway.testing.ports import free_port, wait_for_port
from gateway.testing.processes import terminate

__all__ = ("GOAL_P50_MS", "GOAL_RATIO", "main", "parse_args", "summarize")

log = structlog.get_logger("bench.streaming")

GOAL_RATIO = 0.9
GOAL_P50_MS = 1.0
PROTOCOLS = ("realtime", "sse")


class _Typed(msgspec.Struct):
    type: str = ""


_read_type = msgspec.json.Decoder(_Typed).decode


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.streaming", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--out", type=Path, default=Path("bench/out"))
    ap.add_argument("--deltas", type=int, default=200, help="text deltas a response")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 50])
    ap.add_argument("--seconds", type=float, default=4.0, help="measured window a point")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--protocols", nargs="+", choices=PROTOCOLS, default=list(PROTOCOLS))
    ap.add_argument("--quick", action="store_true", help="one round of 2 s points")
    ap.add_argument(
        "--burst", action="store_true", help="raw servers send a response's deltas back to back"
    )
    ap.add_argument("--profile", action="store_true", help="profile the gateway (cProfile) instead")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.seconds = 1, 2.0
    if args.deltas < 2:
        ap.error("--deltas must be at least 2")
    return args


# ------------------------------------------------------------------ requests


def _prompt(deltas: int) -> str:
    """`deltas - 1` words: the null engine answers each, then one `[0 images]` delta."""
    return " ".join(f"w{i:03d}" for i in range(deltas - 1))


def _realtime_request(prompt: str) -> str:
    message = {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": prompt}],
    }
    response = {"conversation": "none", "input": [message], "max_output_tokens": "inf"}
    return json.dumps({"type": "response.create", "response": response})


def _sse_body(prompt: str, deltas: int) -> dict[str, Any]:
    return {
        "model": "fake-echo",
        "messages": [{"role": "user", "content": prompt}],
        "stream": True,
        "max_tokens": deltas,
    }


# ------------------------------------------------------------------ clients


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) the process `pid` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Window:
    """The measured window a point's clients share: messages inside it, responses ended in it,
    and the CPU time the server used in it."""

    def __init__(self, seconds: float, server_pid: int) -> None:
        self.seconds = seconds
        self.server_pid = server_pid
        self.cpu_s = 0.0
        self.start = self.end = 0.0
        self.messages = 0
        self.latencies_ms: list[float] = []
        self.counts: set[int] = set()  # messages a response, as seen in the warm-up
        self.warm = 0  # clients done with their warm-up
        self.received = 0  # every message, warm-up and the window's edges included

    def open(self) -> None:
        cpu = cpu_seconds(self.server_pid)
        self.start = time.perf_counter()
        self.end = self.start + self.seconds

        def close() -> None:
            self.cpu_s = cpu_seconds(self.server_pid) - cpu

        asyncio.get_running_loop().call_at(self._loop_time(self.end), close)

    def _loop_time(self, t: float) -> float:
        loop = asyncio.get_running_loop()
        return loop.time() + (t - time.perf_counter())

    def inside(self, t: float) -> bool:
        return self.start <= t < self.end

    def ended(self, t0: float, t1: float, messages: int) -> None:
        if self.start == 0.0:
            self.counts.add(messages)
        elif self.inside(t0) and t1 < self.end:
            self.latencies_ms.append((t1 - t0) * 1e3)


async def realtime_client(url: str, request: str, window: Window, warmup: int) -> None:
    from websockets.asyncio.client import connect

    async with connect(url, max_size=None, compression=None) as ws:
        first = await ws.recv()
        assert _read_type(first).type == "session.created", first[:200]
        done = 0
        while window.start == 0.0 or time.perf_counter() < window.end:
            if window.start == 0.0 and done >= warmup:
                window.warm += done == warmup
                done += 1
                await asyncio.sleep(0.005)  # warm, waiting for the others
                continue
            t0 = time.perf_counter()
            await ws.send(request)
            messages = 0
            while True:
                frame = await ws.recv()
                messages += 1
                if window.inside(time.perf_counter()):
                    window.messages += 1
                if _read_type(frame).type == "response.done":
                    break
            window.ended(t0, time.perf_counter(), messages)
            window.received += messages
            done += 1


async def sse_client(url: str, body: dict[str, Any], window: Window, warmup: int) -> None:
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60.0) as client:
        done = 0
        while window.start == 0.0 or time.perf_counter() < window.end:
            if window.start == 0.0 and done >= warmup:
                window.warm += done == warmup
                done += 1
                await asyncio.sleep(0.005)
                continue
            t0 = time.perf_counter()
            messages, rest, finished = 0, b"", False
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    raise RuntimeError(f"{url}: HTTP {response.status_code}")
                async for data in response.aiter_raw():
                    events = (rest + data).split(b"\n\n")
                    rest = events.pop()
                    now = time.perf_counter()
                    for event in events:
                        messages += 1
                        if window.inside(now):
                            window.messages += 1
                        finished = finished or event == b"data: [DONE]"
            if not finished:
                raise RuntimeError(f"{url}: the stream ended without data: [DONE]")
            window.ended(t0, time.perf_counter(), messages)
            window.received += messages
            done += 1


async def run_point(
    protocol: str, url: str, clients: int, seconds: float, deltas: int, server_pid: int
) -> Window:
    """`clients` clients against one server: warm-up, then the measured window."""
    window = Window(seconds, server_pid)
    prompt = _prompt(deltas)
    if protocol == "realtime":
        request = _realtime_request(prompt)
        tasks = [realtime_client(url, request, window, 2) for _ in range(clients)]
    else:
        body = _sse_body(prompt, deltas)
        tasks = [sse_client(url, body, window, 2) for _ in range(clients)]
    running = [asyncio.ensure_future(t) for t in tasks]
    # warm-up: every client's first two responses (connections open, caches filled)
    deadline = time.perf_counter() + 120.0
    while window.warm < clients:
        failed = [t for t in running if t.done()]
        if failed or time.perf_counter() > deadline:
            for t in running:
                t.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            for t in failed:
                t.result()  # its error
            raise TimeoutError(f"{url}: the clients did not warm up")
        await asyncio.sleep(0.02)
    window.open()
    await asyncio.gather(*running)
    return window


# ------------------------------------------------------------------ capture and servers


async def capture(http_url: str, ws_url: str, deltas: int) -> dict[str, list[str]]:
    """One Realtime response's frames and one streamed completion's SSE events, as the gateway
    sends them (the raw servers send the same)."""
    from websockets.asyncio.client import connect

    prompt = _prompt(deltas)
    realtime: list[str] = []
    async with connect(ws_url, max_size=None, compression=None) as ws:
        realtime.append(await ws.recv())
        await ws.send(_realtime_request(prompt))
        while True:
            frame = await ws.recv()
            realtime.append(frame)
            if _read_type(frame).type == "response.done":
                break
        with contextlib.suppress(TimeoutError):  # anything after response.done belongs too
            while True:
                realtime.append(await asyncio.wait_for(ws.recv(), 0.3))
    async with httpx.AsyncClient(base_url=http_url, timeout=60.0) as client:
        r = await client.post("/v1/chat/completions", json=_sse_body(prompt, deltas))
        r.raise_for_status()
    sse = [e + "\n\n" for e in r.text.split("\n\n") if e]
    return {"realtime": realtime, "sse": sse}


class Servers:
    """The gateway and the raw servers, each a child process on loopback."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.procs: list[subprocess.Popen[bytes]] = []
        self.pids: dict[str, int] = {}
        self.gateway_port = free_port()
        self.ws_port, self.sse_port = free_port(), free_port()

    def _spawn(self, args: list[str], log_name: str) -> subprocess.Popen[bytes]:
        with (self.out / log_name).open("wb") as sink:
            proc = subprocess.Popen(
                [sys.executable, "-m", "bench._streaming_servers", *args],
                stdout=sink,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def start_gateway(self, profile: Path | None = None) -> None:
        args = ["gateway", "--port", str(self.gateway_port)]
        if profile is not None:
            args += ["--profile", str(profile)]
        proc = self._spawn(args, "streaming_gateway.log")
        self.pids["gateway"] = proc.pid
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the gateway exited; see {self.out / 'streaming_gateway.log'}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.gateway_url}/readyz").status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError("the gateway was not ready in 60 s")
            time.sleep(0.1)

    def start_raw(self, frames: Path, deltas: int, burst: bool) -> None:
        args = ["raw", "--ws-port", str(self.ws_port), "--sse-port", str(self.sse_port)]
        args += ["--burst"] if burst else []
        proc = self._spawn(
            [*args, "--frames", str(frames), "--deltas", str(deltas)], "streaming_raw.log"
        )
        self.pids["raw"] = proc.pid
        wait_for_port(self.ws_port, timeout=30)
        wait_for_port(self.sse_port, timeout=30)

    def pid(self, side: str) -> int:
        return self.pids[side]

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    def url(self, side: str, protocol: str) -> str:
        if side == "gateway":
            if protocol == "realtime":
                return f"ws://127.0.0.1:{self.gateway_port}/v1/realtime"
            return self.gateway_url
        if protocol == "realtime":
            return f"ws://127.0.0.1:{self.ws_port}"
        return f"http://127.0.0.1:{self.sse_port}"

    def interrupt(self) -> None:
        """SIGINT to every child and wait: a profiled gateway writes its stats on the way out."""
        for proc in self.procs:
            proc.send_signal(signal.SIGINT)
        for proc in self.procs:
            proc.wait(timeout=60)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                terminate(proc, grace_s=10)
        self.procs.clear()


# ------------------------------------------------------------------ report


def summarize(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per protocol and client count: each side's median messages/s over the rounds, p50/p95
    over all its responses, and the ratios."""
    rows = []
    keys = sorted({(p["protocol"], p["clients"]) for p in points}, key=lambda k: (k[0], k[1]))
    for protocol, clients in keys:
        row: dict[str, Any] = {"protocol": protocol, "clients": clients}
        for side in ("raw", "gateway"):
            mine = [
                p
                for p in points
                if p["protocol"] == protocol and p["clients"] == clients and p["side"] == side
            ]
            latencies = [ms for p in mine for ms in p["latencies_ms"]]
            row[side] = {
                "messages_per_s": statistics.median(p["messages_per_s"] for p in mine),
                "responses_per_s": statistics.median(p["responses_per_s"] for p in mine),
                "server_cpu_us_per_message": statistics.median(
                    p["server_cpu_us_per_message"] for p in mine
                ),
                "p50_ms": percentile(latencies, 50),
                "p95_ms": percentile(latencies, 95),
                "rounds": [round(p["messages_per_s"], 1) for p in mine],
            }
        raw, gw = row["raw"], row["gateway"]
        row["ratio"] = (
            gw["messages_per_s"] / raw["messages_per_s"] if raw["messages_per_s"] else None
        )
        # the same round's pair: drift between rounds cancels
        pairs = [g / r for g, r in zip(gw["rounds"], raw["rounds"], strict=True) if r]
        row["ratio_of_rounds"] = statistics.median(pairs) if pairs else None
        row["p50_delta_ms"] = (
            gw["p50_ms"] - raw["p50_ms"]
            if gw["p50_ms"] is not None and raw["p50_ms"] is not None
            else None
        )
        row["meets_goal"] = bool(
            row["ratio"] is not None
            and row["ratio"] >= GOAL_RATIO
            and row["p50_delta_ms"] is not None
            and row["p50_delta_ms"] <= GOAL_P50_MS
        )
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'protocol':<9} {'clients':>7} | {'raw msg/s':>10} {'p50':>7} {'p95':>7} | "
        f"{'gw msg/s':>10} {'p50':>7} {'p95':>7} | {'ratio':>6} {'p50 +ms':>8} goal"
    )
    lines = [head, "-" * len(head)]
    for row in rows:
        raw, gw = row["raw"], row["gateway"]

        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v:.2f}"

        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}x"
        delta = "-" if row["p50_delta_ms"] is None else f"{row['p50_delta_ms']:+.2f}"
        lines.append(
            f"{row['protocol']:<9} {row['clients']:>7} | {raw['messages_per_s']:>10.0f} "
            f"{ms(raw['p50_ms']):>7} {ms(raw['p95_ms']):>7} | {gw['messages_per_s']:>10.0f} "
            f"{ms(gw['p50_ms']):>7} {ms(gw['p95_ms']):>7} | {ratio:>6} {delta:>8} "
            f"{'met' if row['meets_goal'] else 'missed'}"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------ the run


async def measure(servers: Servers, args: argparse.Namespace) -> list[dict[str, Any]]:
    points: list[dict[str, Any]] = []
    total = args.rounds * len(args.protocols) * len(args.clients) * 2
    for round_ in range(args.rounds):
        order = ("raw", "gateway") if round_ % 2 == 0 else ("gateway", "raw")
        for protocol in args.protocols:
            for clients in args.clients:
                counts: dict[str, set[int]] = {}
                for side in order:
                    window = await run_point(
                        protocol,
                        servers.url(side, protocol),
                        clients,
                        args.seconds,
                        args.deltas,
                        servers.pid(side),
                    )
                    counts[side] = window.counts
                    point = {
                        "round": round_,
                        "protocol": protocol,
                        "clients": clients,
                        "side": side,
                        "messages_per_s": window.messages / window.seconds,
                        "responses_per_s": len(window.latencies_ms) / window.seconds,
                        "server_cpu_us_per_message": window.cpu_s * 1e6 / max(window.messages, 1),
                        "latencies_ms": window.latencies_ms,
                        "messages_per_response": sorted(window.counts),
                    }
                    points.append(point)
                    log.info(
                        "point",
                        done=f"{len(points)}/{total}",
                        round=round_,
                        protocol=protocol,
                        clients=clients,
                        side=side,
                        messages_per_s=round(point["messages_per_s"]),
                        p50_ms=round(percentile(window.latencies_ms, 50) or 0.0, 2),
                        cpu_us_per_message=round(point["server_cpu_us_per_message"], 1),
                    )
                if counts["raw"] != counts["gateway"]:
                    raise RuntimeError(
                        f"{protocol}: messages a response differ: raw {sorted(counts['raw'])}, "
                        f"gateway {sorted(counts['gateway'])}"
                    )
    return points


async def profile(servers: Servers, args: argparse.Namespace) -> int:
    """Every point against the gateway alone; every message its clients received."""
    messages = 0
    for protocol in args.protocols:
        for clients in args.clients:
            log.info("profiling", protocol=protocol, clients=clients)
            window = await run_point(
                protocol,
                servers.url("gateway", protocol),
                clients,
                args.seconds,
                args.deltas,
                servers.pid("gateway"),
            )
            messages += window.received
    return messages


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(message)s")
    # progress on stderr with structlog's own processors, whatever a gateway in this process
    # configured before (its stdlib processors do not take a PrintLogger); the stream is looked
    # up as each logger is made, so a run inside a test leaves no logger on a closed capture
    structlog.reset_defaults()
    structlog.configure(logger_factory=lambda *_: structlog.PrintLogger(sys.stderr))
    args.out.mkdir(parents=True, exist_ok=True)
    outcome = RunOutcome()
    servers = Servers(args.out)
    points: list[dict[str, Any]] = []
    with outcome.recording(log):
        try:
            if args.profile:
                stats = args.out / "streaming_profile.pstats"
                servers.start_gateway(profile=stats)
                messages = asyncio.run(profile(servers, args))
                servers.interrupt()
                text = args.out / "streaming_profile.txt"
                _write_profile(stats, text, messages)
                print(f"profile: {text}")
                return outcome.exit_code()
            servers.start_gateway()
            log.info("capturing", deltas=args.deltas)
            frames = asyncio.run(
                capture(servers.gateway_url, servers.url("gateway", "realtime"), args.deltas)
            )
            with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
                json.dump(frames, f)
            servers.start_raw(Path(f.name), args.deltas, args.burst)
            points = asyncio.run(measure(servers, args))
        finally:
            servers.stop()
    rows = summarize(points) if points else []
    report = {
        **outcome.report_fields("streaming"),
        "machine": machine_info(),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "goal": {"ratio": GOAL_RATIO, "p50_delta_ms": GOAL_P50_MS},
        "rows": rows,
        "points": points,
    }
    path = write_json(args.out / "streaming.json", report)
    if rows:
        print(table(rows))
    print(f"wrote {path}")
    return outcome.exit_code()


def _write_profile(stats: Path, text: Path, messages: int) -> None:
    """The gateway's profile, sorted by own time then by cumulative time, under a first line
    with its Python function calls a message (connecting and starting up counted too)."""
    import io
    import pstats

    buf = io.StringIO()
    s = pstats.Stats(str(stats), stream=buf)
    calls = s.total_calls  # type: ignore[attr-defined]
    per = calls / messages if messages else 0.0
    print(f"{calls} function calls, {messages} messages sent: ~{per:.0f} calls a message")
    buf.write(f"{calls} function calls; {messages} messages sent: ~{per:.0f} a message\n")
    s.sort_stats("tottime").print_stats(60)
    s.sort_stats("cumulative").print_stats(60)
    text.write_text(buf.getvalue())


if __name__ == "__main__":
    raise SystemExit(main())
