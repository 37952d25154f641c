"""Webhooks without a server: Standard Webhooks signatures, the SSRF rule, the retry backoff."""

from __future__ import annotations

import ipaddress
import random

import pytest

from api.services.webhooks_delivery import backoff, retryable
from api.webhooks_urls import (
    AllowedHosts,
    Unresolvable,
    UrlRefused,
    check,
    parse_allowed_hosts,
    parse_url,
    vet,
)
from opd_trainer.client.webhooks import WebhookVerificationError, new_secret, sign, verify_webhook

# The example of the Standard Webhooks spec (and of its reference libraries' tests).
SPEC_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
SPEC_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
SPEC_TIMESTAMP = 1614265330
SPEC_BODY = b'{"test": 2432232314}'
SPEC_SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def test_signature_matches_the_standard_webhooks_example() -> None:
    assert sign(SPEC_SECRET, SPEC_ID, SPEC_TIMESTAMP, SPEC_BODY) == SPEC_SIGNATURE


def _headers(secret: str, body: bytes, timestamp: int) -> dict[str, str]:
    return {
        "webhook-id": "evt-1",
        "webhook-timestamp": str(timestamp),
        "webhook-signature": sign(secret, "evt-1", timestamp, body),
    }


def test_verify_accepts_the_signed_body_and_refuses_anything_else() -> None:
    secret, body, now = new_secret(), b'{"type": "job.succeeded"}', 1_700_000_000
    assert secret.startswith("whsec_") and secret != new_secret()
    headers = _headers(secret, body, now)
    assert verify_webhook(secret, headers, body, now=now + 10) == {"type": "job.succeeded"}
    # A rotated secret: several signatures, one of them ours.
    rotated = {**headers, "webhook-signature": "v1,AAAA " + headers["webhook-signature"]}
    assert verify_webhook(secret, rotated, body, now=now)
    refused = [
        (secret, headers, body + b" "),  # body changed
        (new_secret(), headers, body),  # another secret
        (secret, {**headers, "webhook-id": "evt-2"}, body),  # id changed
        (secret, {k: v for k, v in headers.items() if k != "webhook-signature"}, body),
    ]
    for key, sent, content in refused:
        with pytest.raises(WebhookVerificationError):
            verify_webhook(key, sent, content, now=now)
    with pytest.raises(WebhookVerificationError, match="too far"):
        verify_webhook(secret, headers, body, now=now + 3600)  # a replay an hour later


def _ip(*addresses: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    return [ipaddress.ip_address(a) for a in addresses]


@pytest.mark.parametrize(
    ("address", "kind"),
    [
        ("127.0.0.1", "loopback"),
        ("10.1.2.3", "private"),
        ("172.16.0.1", "private"),
        ("192.168.1.1", "private"),
        ("169.254.169.254", "link-local"),
        ("100.64.0.1", "non-public"),
        ("224.0.0.1", "multicast"),
        ("0.0.0.0", "unspecified"),
        ("240.0.0.1", "reserved"),
        ("::1", "loopback"),
        ("fc00::1", "private"),
        ("fe80::1", "link-local"),
        ("::ffff:127.0.0.1", "loopback"),
        ("::ffff:169.254.169.254", "link-local"),
    ],
)
def test_non_public_addresses_are_refused(address: str, kind: str) -> None:
    url = parse_url("https://hooks.example.com/x")
    with pytest.raises(UrlRefused, match=f"a {kind} address"):
        check(url, _ip(address), AllowedHosts())
    # One bad address among good ones is enough (a client could connect to any of them).
    with pytest.raises(UrlRefused):
        check(url, _ip("93.184.216.34", address), AllowedHosts())


def test_https_to_public_addresses_is_accepted_and_pinned() -> None:
    target = check(parse_url("https://Hooks.Example.com:8443/in?x=1"), _ip("93.184.216.34"), AllowedHosts())
    assert target.pinned_url == "https://93.184.216.34:8443/in?x=1"
    assert target.url.host == "hooks.example.com" and target.url.host_header == "hooks.example.com:8443"
    v6 = check(parse_url("https://hooks.example.com"), _ip("2606:4700::1"), AllowedHosts())
    assert v6.pinned_url == "https://[2606:4700::1]:443/"
    with pytest.raises(UrlRefused, match="https"):
        check(parse_url("http://hooks.example.com/x"), _ip("93.184.216.34"), AllowedHosts())


@pytest.mark.parametrize(
    "url",
    [
        "ftp://hooks.example.com/x",
        "file:///etc/passwd",
        "hooks.example.com/x",
        "https://user:pw@hooks.example.com/x",
        "https://hooks.example.com/x#frag",
        "https://hooks.example.com:99999/x",
        "https://hooks.example.com/a b",
        "https://" + "a" * 2100 + ".com/",
    ],
)
def test_malformed_urls_are_refused(url: str) -> None:
    with pytest.raises(UrlRefused):
        parse_url(url)


@pytest.mark.parametrize(
    "url",
    [
        "https://127.0.0.1/x",
        "https://localhost/x",
        "https://10.0.0.1/x",
        "https://169.254.169.254/latest/meta-data/",
        "https://[::1]/x",
        "https://0x7f.1/x",  # 127.0.0.1 spelt otherwise
        "https://2130706433/x",  # likewise
        "https://0.0.0.0/x",
    ],
)
def test_vet_resolves_before_it_decides(url: str) -> None:
    with pytest.raises(UrlRefused):
        vet(url, AllowedHosts())


def test_vet_accepts_a_public_address_literal() -> None:
    assert str(vet("https://93.184.216.34/hook", AllowedHosts()).address) == "93.184.216.34"


def test_an_unresolvable_host_is_refused_as_such() -> None:
    with pytest.raises(Unresolvable):
        vet("https://no-such-host.invalid/hook", AllowedHosts())


def test_allowed_hosts_open_named_receivers_and_networks() -> None:
    allowed = parse_allowed_hosts(
        ["hooks.internal", "relay.internal:8443", "127.0.0.1:9000", "10.20.0.0/16", "[::1]:9000"]
    )
    assert ("hooks.internal", None) in allowed.names and ("relay.internal", 8443) in allowed.names
    # A named host: any address, http too; a name with a port: that port only.
    check(parse_url("http://hooks.internal:81/x"), _ip("10.0.0.5"), allowed)
    check(parse_url("https://relay.internal:8443/x"), _ip("192.168.0.2"), allowed)
    with pytest.raises(UrlRefused):
        check(parse_url("https://relay.internal/x"), _ip("192.168.0.2"), allowed)
    # A network (with or without a port): its addresses, http too.
    check(parse_url("http://10.20.3.4/x"), _ip("10.20.3.4"), allowed)
    check(parse_url("http://127.0.0.1:9000/x"), _ip("127.0.0.1"), allowed)
    check(parse_url("http://[::1]:9000/x"), _ip("::1"), allowed)
    for url, address in [
        ("http://127.0.0.1:9001/x", "127.0.0.1"),  # another port
        ("http://10.21.0.1/x", "10.21.0.1"),  # outside the network
        ("https://169.254.169.254/x", "169.254.169.254"),
    ]:
        with pytest.raises(UrlRefused):
            check(parse_url(url), _ip(address), allowed)
    # The allowed loopback receiver on its port, but through a name that also resolves to ::1: refused.
    with pytest.raises(UrlRefused):
        check(parse_url("http://localhost:9000/x"), _ip("127.0.0.1", "::2"), allowed)


@pytest.mark.parametrize("entry", ["http://x", "host:port", "10.0.0.0/33", "a b", "h:0", "bad_host!"])
def test_bad_allowed_host_entries_fail_fast(entry: str) -> None:
    with pytest.raises(ValueError, match="webhook allowed host"):
        parse_allowed_hosts([entry])


def test_settings_read_allowed_hosts_comma_separated(monkeypatch: pytest.MonkeyPatch) -> None:
    from pydantic import ValidationError

    from api.settings import Settings

    monkeypatch.setenv("OPD_WEBHOOK_ALLOWED_HOSTS", " hooks.internal , 127.0.0.1:9000,")
    assert Settings().webhook_allowed_hosts == ["hooks.internal", "127.0.0.1:9000"]
    monkeypatch.setenv("OPD_WEBHOOK_ALLOWED_HOSTS", "http://hooks.internal")
    with pytest.raises(ValidationError, match="webhook allowed host"):
        Settings()
    monkeypatch.delenv("OPD_WEBHOOK_ALLOWED_HOSTS")
    with pytest.raises(ValidationError, match="webhook_backoff_cap_s"):
        Settings(webhook_backoff_base_s=10, webhook_backoff_cap_s=5)


def test_backoff_doubles_up_to_the_cap_with_jitter() -> None:
    rng = random.Random(7)
    for failures, ceiling in [(1, 2.0), (2, 4.0), (3, 8.0), (6, 60.0), (30, 60.0)]:
        waits = [backoff(failures, 2.0, 60.0, rng) for _ in range(200)]
        assert all(ceiling / 2 <= w <= ceiling for w in waits)
        assert max(waits) - min(waits) > ceiling / 10  # jittered, not one value
    assert [retryable(s) for s in (200, 301, 400, 404, 429, 500, 503)] == [
        False,
        False,
        False,
        False,
        True,
        True,
        True,
    ]
