"""Soak benchmark: the slow-client flood, in a process of its own.

    python -m bench._soak_flood URL SECONDS CONNECTIONS   # the key in SOAK_FLOOD_KEY

`CONNECTIONS` connections to the gateway at `URL`: each sends half a request line with no key
and waits (the first `TRICKLERS` send a whole head with the key and then a body a byte a
second), and is reopened as soon as the gateway closes it, for `SECONDS`. Prints one JSON
object: how each connection ended, by code (`closed:<status>`, `closed:no answer`,
`unfinished`, `connect:<error>`), also when stopped early with SIGTERM.

It runs apart from the benchmark's clients on purpose: hundreds of connections waking every
second on the same event loop as the well-behaved users delayed their own requests by seconds
on a loaded 2-core machine, which the benchmark then charged to the gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections import Counter
from urllib.parse import urlsplit

__all__ = ("TRICKLERS", "flood")

TRICKLERS = 4  # of the connections, those trickling a body rather than a head


async def _one(url: str, key: str, stop_at: float, *, trickle: bool, counts: Counter[str]) -> None:
    loop = asyncio.get_running_loop()
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
        f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
        "Content-Length: 100000\r\n\r\n"
    ).encode()
    while loop.time() < stop_at:
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError as exc:
            counts[f"connect:{type(exc).__name__}"] += 1
            await asyncio.sleep(1.0)
            continue
        answer = b""
        try:
            writer.write(head if trickle else b"GET /v1/chat/compl")
            while loop.time() < stop_at:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(1.0):
                        answer = await reader.read(256)
                        break
                if trickle:
                    writer.write(b" ")
            else:
                counts["unfinished"] += 1
                continue
            status = answer.split(b" ", 2)[1].decode() if answer[:5] == b"HTTP/" else ""
            counts[f"closed:{status or 'no answer'}"] += 1
        except (OSError, IndexError, UnicodeDecodeError) as exc:
            counts[f"closed:{type(exc).__name__}"] += 1
        finally:
            writer.close()


async def flood(url: str, key: str, seconds: float, connections: int) -> Counter[str]:
    """Run the flood for `seconds`, or until SIGTERM; how its connections ended, by code."""
    loop = asyncio.get_running_loop()
    counts: Counter[str] = Counter()
    stop_at = loop.time() + seconds
    task = asyncio.gather(
        *(_one(url, key, stop_at, trickle=i < TRICKLERS, counts=counts) for i in range(connections))
    )
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return counts


def main(argv: list[str]) -> int:
    url, seconds, connections = argv[0], float(argv[1]), int(argv[2])
    counts = asyncio.run(flood(url, os.environ.get("SOAK_FLOOD_KEY", ""), seconds, connections))
    print(json.dumps(dict(counts)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
