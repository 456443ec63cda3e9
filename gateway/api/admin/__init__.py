"""The admin API: managed API keys (`/v1/admin/keys`) and their usage (`/v1/admin/usage`),
behind the `admin_api_key` setting; absent when it is empty.

`protocol` holds the wire Structs, `serving` the checks and the key store calls, `router` the
thin Litestar handlers.
"""

from __future__ import annotations

from gateway.api.admin.router import admin_route_handlers

__all__ = ("admin_route_handlers",)
