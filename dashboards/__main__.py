"""``python -m dashboards [--check]``: regenerate (or check) the committed JSON."""

from __future__ import annotations

from dashboards.build import main

raise SystemExit(main())
