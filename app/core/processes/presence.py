"""Who is up: the presence records that every long-running process keeps in Redis
(workers/presence.py writes an inference or ops worker's, app/dispatcher/loop.py a
dispatcher's), read by `inferq up`, `inferq status`, the console, the catalog of models, the
reaper and the API's Prometheus service discovery; and each live process's /metrics as a
scrape target.

A record expires a few heartbeats after its process stops announcing, so a process that died
without saying goodbye drops out by itself; nothing here is kept between calls.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit

import redis

from app.core.messaging.names import PRESENCE_KEY_PREFIXES, Role


def presence(client: redis.Redis, role: Role) -> list[dict[str, Any]]:
    """The presence records of live processes of ``role`` (``inference`` or ``ops``;
    ``workers/presence.py``), sorted by worker id.

    A record expires a few heartbeats after its process stops announcing, so a dead worker
    drops out of this list by itself.
    """
    prefix = PRESENCE_KEY_PREFIXES[role]
    found: list[dict[str, Any]] = []
    for key in client.scan_iter(match=prefix + "*", count=100):
        raw = client.get(key)
        if raw is None:  # expired between SCAN and GET
            continue
        try:
            record = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(record, dict):
            continue
        name = key.decode() if isinstance(key, bytes) else str(key)
        record.setdefault("worker_id", name.removeprefix(prefix))
        found.append(record)
    return sorted(found, key=lambda record: str(record["worker_id"]))


def workers(client: redis.Redis) -> list[dict[str, Any]]:
    """Live inference workers (``workers/inference/heartbeat.py``), sorted by worker id."""
    return presence(client, "inference")


def ops_workers(client: redis.Redis) -> list[dict[str, Any]]:
    """Live ops workers (``workers/ops.py``), sorted by worker id."""
    return presence(client, "ops")


def dispatchers(client: redis.Redis) -> list[dict[str, Any]]:
    """Live dispatchers (``app/dispatcher/loop.py``), sorted by id."""
    return presence(client, "dispatcher")


# Target labels taken from a presence record; `worker`, `engine` and `model` are also the labels
# of inferq_worker_info, so a query can join a target's series on them.
TARGET_LABELS = {"worker": "worker_id", "engine": "engine", "model": "model"}


def metrics_targets(client: redis.Redis) -> list[dict[str, Any]]:
    """Every live worker's and ops worker's /metrics, in Prometheus's HTTP service discovery
    format: ``[{"targets": ["host:port"], "labels": {...}}]``, one group per process.

    Labels: ``role`` (``inference`` or ``ops``), ``worker`` (the worker id), ``engine`` and
    ``model`` (inference workers), and ``__scheme__`` and ``__metrics_path__`` from the URL the
    process announced. A record without a metrics URL (a worker still starting) is left out.
    """
    groups: list[dict[str, Any]] = []
    for role in PRESENCE_KEY_PREFIXES:
        for record in presence(client, role):
            url = urlsplit(str(record.get("metrics_url") or ""))
            if not url.netloc:
                continue
            labels = {
                "role": role,
                "__scheme__": url.scheme or "http",
                "__metrics_path__": url.path or "/metrics",
            }
            for label, field_name in TARGET_LABELS.items():
                if record.get(field_name):
                    labels[label] = str(record[field_name])
            groups.append({"targets": [url.netloc], "labels": labels})
    return groups
