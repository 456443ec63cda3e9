"""How a benchmark run ended: complete, interrupted (Ctrl-C or SIGTERM) or failed, recorded
once for every benchmark that drives gateways, and the report fields and exit code that say so.

A run that did not complete still writes its report (what it measured so far), marked with its
status and error, and exits non-zero.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

__all__ = ("RunOutcome",)


class RunOutcome:
    __slots__ = ("error", "started", "status")

    def __init__(self) -> None:
        self.status = "complete"
        self.error: str | None = None
        self.started = datetime.now(UTC)

    @contextlib.contextmanager
    def recording(self, log: Any) -> Iterator[None]:
        """Run the body; an interrupt or an exception ends the run, recorded, not raised."""
        try:
            yield
        except KeyboardInterrupt:
            self.status = self.error = "interrupted"
            log.warning("interrupted")
        except Exception as exc:
            self.status, self.error = "failed", f"{type(exc).__name__}: {exc}"
            log.error("run_failed", error=self.error)

    def report_fields(self, benchmark: str) -> dict[str, Any]:
        return {
            "benchmark": benchmark,
            "status": self.status,
            "error": self.error,
            "started": self.started.isoformat(),
            "finished": datetime.now(UTC).isoformat(),
        }

    def exit_code(self) -> int:
        """0 for a complete run; otherwise says why on stderr: 130 interrupted, 1 failed."""
        if self.status == "complete":
            return 0
        print(f"run {self.status}: {self.error}", file=sys.stderr)
        return 130 if self.status == "interrupted" else 1
