"""Provision the visiongate folder, dashboards and SLO alert rules into a Grafana instance.

Idempotent: the folder is created when missing, dashboards are saved with ``overwrite``, and
each alert rule is created or updated by its uid. It does not create datasources, contact
points or notification policies; the rules reference an existing Prometheus datasource uid.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec
from grafana_client import GrafanaApi
from grafana_client.client import GrafanaClientError

from dashboards.alerts import RULE_GROUP, alert_rules
from dashboards.build import build_all

__all__ = ("PushSummary", "push")


class PushSummary(msgspec.Struct, frozen=True):
    """What a push did: the folder, dashboards saved (uid -> Grafana URL path) and rules."""

    folder_uid: str
    folder_created: bool
    dashboards: dict[str, str]
    rules_created: list[str]
    rules_updated: list[str]
    rule_group: str = RULE_GROUP


def _folder_uid(title: str) -> str:
    slug = re.sub(r"[^a-zA-Z0-9_-]+", "-", title.strip().lower()).strip("-")
    return (slug or "visiongate")[:40]


def _ensure_folder(api: GrafanaApi, title: str) -> tuple[str, bool]:
    uid = _folder_uid(title)
    try:
        api.folder.get_folder(uid)
        return uid, False
    except GrafanaClientError as exc:
        if exc.status_code != 404:
            raise
    api.folder.create_folder(title, uid=uid)
    return uid, True


def push(
    url: str,
    token: str,
    folder: str = "visiongate",
    *,
    datasource_uid: str = "visiongate-prometheus",
    timeout: float = 10.0,
) -> PushSummary:
    """Push every dashboard and alert rule to the Grafana at ``url`` using API ``token``
    (a service-account token with dashboard, folder and alert-rule write access)."""
    api = GrafanaApi.from_url(url, credential=token, timeout=timeout)
    folder_uid, created = _ensure_folder(api, folder)

    saved: dict[str, str] = {}
    for name, document in build_all().items():
        if not name.startswith("visiongate-"):
            continue
        body: dict[str, Any] = {
            "dashboard": {**document, "id": None},
            "folderUid": folder_uid,
            "overwrite": True,
            "message": "visiongate dashboards push",
        }
        response = api.dashboard.update_dashboard(body)
        saved[document["uid"]] = str((response or {}).get("url", ""))

    rules_created: list[str] = []
    rules_updated: list[str] = []
    for rule in alert_rules(folder_uid=folder_uid, datasource_uid=datasource_uid):
        try:
            api.alertingprovisioning.get_alertrule(rule["uid"])
        except GrafanaClientError as exc:
            if exc.status_code != 404:
                raise
            api.alertingprovisioning.create_alertrule(rule)
            rules_created.append(rule["uid"])
        else:
            api.alertingprovisioning.update_alertrule(rule["uid"], rule)
            rules_updated.append(rule["uid"])

    return PushSummary(
        folder_uid=folder_uid,
        folder_created=created,
        dashboards=saved,
        rules_created=rules_created,
        rules_updated=rules_updated,
    )
