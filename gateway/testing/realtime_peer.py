"""A thin raw-WebSocket peer for protocol tests: sends dicts, collects server events.

`data_url` is `gateway.testing.images.data_url`, importable from here too for the tests that
build a Realtime image part next to a `Peer`.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import websockets

from gateway.testing.images import data_url

__all__ = ("Peer", "data_url", "deltas")


class Peer:
    def __init__(self, ws: Any, created: dict[str, Any]) -> None:
        self.ws = ws
        self.created = created

    @classmethod
    async def open(cls, url: str, session_id: str | None = None) -> Peer:
        ws = await websockets.connect(
            url + (f"?session_id={session_id}" if session_id else ""), max_size=None
        )
        created = json.loads(await ws.recv())
        return cls(ws, created)

    @property
    def session_id(self) -> str:
        return self.created["session"]["id"]

    async def send(self, event: dict[str, Any] | str | bytes) -> None:
        await self.ws.send(event if isinstance(event, (str, bytes)) else json.dumps(event))

    async def recv(self, timeout: float = 120.0) -> dict[str, Any]:
        return json.loads(await asyncio.wait_for(self.ws.recv(), timeout))

    async def until(
        self, *types: str, timeout: float = 180.0
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Read until an event of one of `types`; returns it and everything read before it."""
        seen: list[dict[str, Any]] = []
        while True:
            event = await self.recv(timeout)
            if event["type"] in types:
                return event, seen
            seen.append(event)

    async def add(
        self, parts: list[dict[str, Any]], event_id: str | None = None, role: str = "user"
    ) -> None:
        event: dict[str, Any] = {
            "type": "conversation.item.create",
            "item": {"type": "message", "role": role, "content": parts},
        }
        if event_id:
            event["event_id"] = event_id
        await self.send(event)

    async def respond(self, **params: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        await self.send({"type": "response.create", "response": params})
        return await self.until("response.done")

    async def close(self) -> None:
        await self.ws.close()


def deltas(events: list[dict[str, Any]]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
