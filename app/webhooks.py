"""Webhook rules shared by the API and the ops worker: URL policy, signing, schedule, body.

- **URL policy**: a ``webhook_url`` must be http(s) and its host must resolve only to global
  addresses; private, loopback, link-local (cloud metadata included), CGNAT, multicast and
  reserved ranges are refused, for IPv4, IPv6 and IPv4-mapped IPv6 alike, unless
  ``INFERQ_WEBHOOK_ALLOW_PRIVATE`` is set. The API checks at submit time; the ops worker checks
  again at delivery time and connects to the address it checked, so DNS cannot be switched
  to an internal address in between.
- **Signing**: Standard Webhooks, through the ``standardwebhooks`` library. During a rotation
  (``INFERQ_WEBHOOK_SECRET_PREVIOUS`` set) every request carries both signatures.
- **Schedule**: the first attempt is immediate; ``INFERQ_WEBHOOK_RETRY_SCHEDULE`` gives the
  waits before each retry. After the last one the event is failed.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import os
import secrets
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from standardwebhooks import Webhook

from app.settings import Settings

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
JOB_EVENT_PREFIX = "job."
SECRET_FILE = "webhook_secret"  # noqa: S105 - a file name, not a secret


class WebhookUrlError(ValueError):
    """A webhook URL that inferq will not call."""


@dataclass(frozen=True)
class Target:
    """A checked webhook URL: where to connect and what to tell the server."""

    url: str
    scheme: str
    host: str
    port: int
    addresses: tuple[IPAddress, ...]


def is_public(address: IPAddress) -> bool:
    """True for globally routable unicast addresses only."""
    if isinstance(address, ipaddress.IPv6Address):
        # ::ffff:10.0.0.1 and 2002:a00:1::/48 (6to4) reach IPv4 hosts: judge those.
        embedded = address.ipv4_mapped or address.sixtofour
        if embedded is not None:
            return is_public(embedded)
        if address.teredo is not None:
            return all(is_public(a) for a in address.teredo)
    return address.is_global and not address.is_multicast


def check_url(url: str, allow_private: bool) -> Target:
    """Resolve ``url``'s host and apply the policy; raises :class:`WebhookUrlError`."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise WebhookUrlError("webhook_url must be an http(s) URL")
    host = parts.hostname
    if not host:
        raise WebhookUrlError("webhook_url has no host")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        raise WebhookUrlError(f"webhook_url has a bad port: {exc}") from None
    try:
        addresses: tuple[IPAddress, ...] = (ipaddress.ip_address(host),)
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:
            raise WebhookUrlError(f"webhook_url host {host!r} does not resolve: {exc}") from None
        found = dict.fromkeys(ipaddress.ip_address(info[4][0]) for info in infos)
        addresses = tuple(found)
    if not addresses:
        raise WebhookUrlError(f"webhook_url host {host!r} does not resolve")
    if not allow_private:
        for address in addresses:
            if not is_public(address):
                raise WebhookUrlError(
                    f"webhook_url host {host!r} is {address}, a private, loopback, link-local "
                    "or otherwise non-public address (INFERQ_WEBHOOK_ALLOW_PRIVATE allows it)"
                )
    return Target(url, parts.scheme, host, port, addresses)


def load_secret(settings: Settings) -> str:
    """The current signing secret: the setting, or one made once and kept in ``data_dir``."""
    if settings.webhook_secret is not None:
        return settings.webhook_secret.get_secret_value()
    path = Path(settings.data_dir) / SECRET_FILE
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    secret = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
    try:
        # O_EXCL: when several processes start at once, the first file written wins.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text().strip()
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    return secret


def signing_secrets(settings: Settings) -> list[str]:
    found = [load_secret(settings)]
    if settings.webhook_secret_previous is not None:
        found.append(settings.webhook_secret_previous.get_secret_value())
    return found


def signed_headers(event_id: str, body: str, at: float, secrets_: list[str]) -> dict[str, str]:
    """Standard Webhooks headers for one attempt of one event."""
    moment = datetime.fromtimestamp(int(at), UTC)
    signatures = " ".join(Webhook(s).sign(event_id, moment, body) for s in secrets_)
    return {
        "webhook-id": event_id,
        "webhook-timestamp": str(int(at)),
        "webhook-signature": signatures,
        "content-type": "application/json",
        "user-agent": "inferq-webhooks/1",
    }


def retry_delay(settings: Settings, attempts_in_round: int) -> float | None:
    """Seconds until the next attempt after ``attempts_in_round`` failures; None: give up."""
    delays = settings.webhook_retry_delays
    if attempts_in_round - 1 < len(delays):
        return delays[attempts_in_round - 1]
    return None


def render(event_type: str, occurred_at: float, data: Mapping[str, Any]) -> str:
    """The body: ``{"type", "timestamp" (ISO 8601 UTC), "data"}``, compact JSON."""
    timestamp = datetime.fromtimestamp(occurred_at, UTC).isoformat().replace("+00:00", "Z")
    return json.dumps(
        {"type": event_type, "timestamp": timestamp, "data": data}, separators=(",", ":")
    )
