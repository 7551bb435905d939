"""The webhook URL policy, signing and schedule (app/core/webhooks/rules.py), without a network."""

from __future__ import annotations

import ipaddress
import time
from pathlib import Path

import pytest
from standardwebhooks import Webhook, WebhookVerificationError

from app.core.settings import Settings
from app.core.webhooks import rules

REFUSED = [
    "127.0.0.1",
    "10.0.0.1",
    "172.16.5.4",
    "192.168.1.1",
    "169.254.169.254",  # cloud metadata (link-local)
    "100.64.0.1",  # CGNAT
    "100.100.100.200",  # Alibaba metadata, inside CGNAT
    "0.0.0.0",
    "224.0.0.1",
    "255.255.255.255",
    "::1",
    "::",
    "fe80::1",
    "fd00:ec2::254",  # AWS metadata over IPv6 (unique local)
    "::ffff:127.0.0.1",  # IPv4-mapped loopback
    "::ffff:169.254.169.254",
    "2002:7f00:1::1",  # 6to4 of 127.0.0.1
    "ff02::1",
    "64:ff9b::a9fe:a9fe",  # NAT64 of 169.254.169.254
    "64:ff9b::7f00:1",
    "64:ff9b:1::1",
    "::127.0.0.1",  # IPv4-compatible
    "::ffff:0:7f00:1",
    "fec0::1",  # site-local
    "2001::7f00:1",  # Teredo; its embedded server and client are not public
]
ALLOWED = ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "::ffff:8.8.8.8"]


@pytest.mark.parametrize("address", REFUSED)
def test_non_public_addresses_are_refused(address: str) -> None:
    assert not rules.is_public(ipaddress.ip_address(address))
    host = f"[{address}]" if ":" in address else address
    with pytest.raises(rules.WebhookUrlError, match="non-public"):
        rules.check_url(f"https://{host}/hook", allow_private=False)
    # The setting lets them through (tests and private deployments).
    target = rules.check_url(f"https://{host}/hook", allow_private=True)
    assert target.addresses == (ipaddress.ip_address(address),)


@pytest.mark.parametrize("address", ALLOWED)
def test_public_addresses_pass(address: str) -> None:
    host = f"[{address}]" if ":" in address else address
    target = rules.check_url(f"http://{host}:8080/x?y=1", allow_private=False)
    assert target.port == 8080 and target.scheme == "http"


def test_hostnames_are_judged_by_what_they_resolve_to() -> None:
    with pytest.raises(rules.WebhookUrlError, match="non-public"):
        rules.check_url("http://localhost/hook", allow_private=False)
    target = rules.check_url("http://localhost:1234/hook", allow_private=True)
    assert target.host == "localhost" and target.port == 1234
    assert all(a.is_loopback for a in target.addresses)


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("ftp://8.8.8.8/x", "http"),
        ("file:///etc/passwd", "http"),
        ("http:///nohost", "no host"),
        ("http://8.8.8.8:99999/", "port"),
        ("http://no-such-host.invalid/", "does not resolve"),
        ("http://[::1/", "not a valid URL"),
        ("http://[evil.example]/", "not a valid URL"),
    ],
)
def test_malformed_urls_are_refused(url: str, why: str) -> None:
    with pytest.raises(rules.WebhookUrlError, match=why):
        rules.check_url(url, allow_private=True)


def test_signatures_verify_with_the_library_and_rotation_sends_both() -> None:
    new, old = "whsec_" + "A" * 32, "whsec_" + "B" * 32
    body = rules.render("job.succeeded", 1_700_000_000.5, {"id": "job_1"})
    headers = rules.signed_headers("msg_1", body, time.time(), [new, old])
    assert headers["webhook-id"] == "msg_1"
    assert Webhook(new).verify(body, headers)["data"] == {"id": "job_1"}
    assert Webhook(old).verify(body, headers)["type"] == "job.succeeded"
    with pytest.raises(WebhookVerificationError):
        Webhook("whsec_" + "C" * 32).verify(body, headers)
    with pytest.raises(WebhookVerificationError):
        Webhook(new).verify(body.replace("job_1", "job_2"), headers)


def test_retry_schedule_and_its_validation() -> None:
    settings = Settings(webhook_retry_schedule="5, 300,1800")
    assert settings.webhook_retry_delays == [5.0, 300.0, 1800.0]
    assert [rules.retry_delay(settings, n) for n in (1, 2, 3, 4)] == [5.0, 300.0, 1800.0, None]
    default = Settings()
    assert default.webhook_retry_delays == [5, 300, 1800, 7200, 18000, 36000, 36000]
    for bad in ("5,-1", "soon"):
        with pytest.raises(ValueError, match="webhook_retry_schedule"):
            Settings(webhook_retry_schedule=bad)


def test_default_secret_is_made_once_and_kept(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    secret = rules.load_secret(settings)
    assert secret.startswith("whsec_") and rules.load_secret(settings) == secret
    assert (tmp_path / rules.SECRET_FILE).stat().st_mode & 0o777 == 0o600
    Webhook(secret)  # a valid Standard Webhooks secret
    explicit = Settings(data_dir=tmp_path, webhook_secret="whsec_" + "D" * 32)
    assert rules.load_secret(explicit) == "whsec_" + "D" * 32
