"""Webhook rules shared by the API and the ops worker: URL policy, signing, schedule, body.

- **URL policy**: a ``webhook_url`` must be http(s) and its host must resolve only to global
  addresses; private, loopback, link-local (cloud metadata included), CGNAT, multicast and
  reserved ranges are refused, for IPv4, IPv6 and IPv4-mapped IPv6 alike, unless
  ``INFERQ_WEBHOOK_ALLOW_PRIVATE`` is set. The API checks at submit time; the ops worker checks
  again at delivery time and connects to the address it checked, so DNS cannot be switched
  to an internal address in between.
- **Signing**: Standard Webhooks, through the ``standardwebhooks`` library. During a rotation
  (``INFERQ_WEBHOOK_SECRET_PREVIOUS`` set) every request carries both signatures. A registered
  endpoint's events are signed with that endpoint's own secret (app/core/webhooks/endpoints.py).
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
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from standardwebhooks import Webhook

from app.core.errors import DomainError, Kind, unavailable
from app.core.settings import Settings, get_settings

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
JOB_EVENT_PREFIX = "job."
BATCH_EVENT_PREFIX = "batch."
SECRET_FILE = "webhook_secret"  # noqa: S105 - a file name, not a secret


class WebhookUrlError(ValueError):
    """A webhook URL that inferq will not call (``temporary``: DNS did not answer now)."""

    def __init__(self, message: str, *, temporary: bool = False) -> None:
        super().__init__(message)
        self.temporary = temporary


@dataclass(frozen=True)
class Target:
    """A checked webhook URL: where to connect and what to tell the server."""

    url: str
    scheme: str
    host: str
    port: int
    addresses: tuple[IPAddress, ...]


GLOBAL_UNICAST_V6 = ipaddress.IPv6Network("2000::/3")


def is_public(address: IPAddress) -> bool:
    """True for globally routable unicast addresses only.

    IPv6 must be global unicast (2000::/3), which leaves out IPv4-compatible, NAT64
    (64:ff9b::/96, 64:ff9b:1::/48) and site-local forms that can reach IPv4 or internal hosts;
    IPv4-mapped, 6to4 and Teredo addresses are judged by the IPv4 address they carry.
    """
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return is_public(address.ipv4_mapped)
        if address not in GLOBAL_UNICAST_V6:
            return False
        if address.sixtofour is not None:
            return is_public(address.sixtofour)
        if address.teredo is not None:
            return all(is_public(a) for a in address.teredo)
    return address.is_global and not address.is_multicast


def check_url(url: str, allow_private: bool) -> Target:
    """Resolve ``url``'s host and apply the policy; raises :class:`WebhookUrlError`."""
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # e.g. an unbalanced "[" in the host
        raise WebhookUrlError(f"webhook_url is not a valid URL: {exc}") from None
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
        except socket.gaierror as exc:
            raise WebhookUrlError(
                f"webhook_url host {host!r} does not resolve: {exc}",
                temporary=exc.errno == socket.EAI_AGAIN,
            ) from None
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


def check_webhook_url(
    url: str | None, checked: set[str] | None = None, *, param: str = "webhook_url"
) -> None:
    """Refuse a webhook URL the ops worker would not call (``param`` names the field at
    fault); ``checked`` skips repeats."""
    if url is None or (checked is not None and url in checked):
        return
    try:
        check_url(url, get_settings().webhook_allow_private)
    except WebhookUrlError as exc:
        if exc.temporary:  # DNS did not answer: the URL may well be fine
            raise unavailable("dns_unavailable", str(exc), param=param) from None
        raise DomainError(Kind.INVALID, "webhook_url_refused", str(exc), param=param) from None
    if checked is not None:
        checked.add(url)


def new_secret() -> str:
    """A Standard Webhooks secret: ``whsec_`` and 32 random bytes in base64."""
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


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
    secret = new_secret()
    # Written whole to a private temporary file, then linked into place: a process starting at
    # the same moment either wins the link or reads a complete file, never an empty one.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".webhook_secret.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secret + "\n")
        os.link(tmp, path)
    except FileExistsError:
        return path.read_text().strip()
    finally:
        os.unlink(tmp)
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


def render_openai(event_id: str, event_type: str, occurred_at: float, object_id: str) -> str:
    """The body of an event for a registered endpoint, in OpenAI's shape: ``{"id", "object":
    "event", "created_at" (Unix seconds), "type", "data": {"id"}}``, compact JSON. The receiver
    fetches the batch or response by its id, as with OpenAI's own events."""
    return json.dumps(
        {
            "id": event_id,
            "object": "event",
            "created_at": int(occurred_at),
            "type": event_type,
            "data": {"id": object_id},
        },
        separators=(",", ":"),
    )


def render(event_type: str, occurred_at: float, data: Mapping[str, Any]) -> str:
    """The body: ``{"type", "timestamp" (ISO 8601 UTC), "data"}``, compact JSON."""
    timestamp = datetime.fromtimestamp(occurred_at, UTC).isoformat().replace("+00:00", "Z")
    return json.dumps(
        {"type": event_type, "timestamp": timestamp, "data": data}, separators=(",", ":")
    )
