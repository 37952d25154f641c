"""Where webhooks may go: the public internet, or receivers the operator allows; no server-side request
forgery into the cluster.

A webhook URL must be `https` and its host must resolve only to public addresses: loopback, private,
link-local (169.254.169.254, the cloud metadata service, among them), shared (100.64/10), multicast,
reserved and unspecified addresses are refused. `OPD_WEBHOOK_ALLOWED_HOSTS` opens named receivers
(`host`, `host:port`) and networks (an IP address or a CIDR, with or without a port); those may also be
plain `http`. The URL is checked when it is registered and again before every attempt, since its name
may resolve elsewhere by then (DNS rebinding); an attempt connects to the address that was checked, not
to a second resolution of the name (`Target.address`). Redirects are never followed (the deliverer).

Nothing here imports the server's settings: `api.settings` validates the allowed hosts with
`parse_allowed_hosts`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
MAX_URL_LENGTH = 2048
HOST_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*\.?$")
DEFAULT_PORTS = {"http": 80, "https": 443}
ALLOW_SETTING = "OPD_WEBHOOK_ALLOWED_HOSTS"


class UrlRefused(Exception):
    """The URL may not receive webhooks (its form, its scheme or where it resolves); permanent."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class Unresolvable(UrlRefused):
    """The host does not resolve (now): at delivery time, an error worth retrying."""


@dataclass(frozen=True)
class AllowedHosts:
    """`OPD_WEBHOOK_ALLOWED_HOSTS`, parsed: host names and networks, each with a port or any (None)."""

    names: frozenset[tuple[str, int | None]] = frozenset()
    networks: tuple[tuple[IPNetwork, int | None], ...] = ()

    def names_host(self, host: str, port: int) -> bool:
        return (host, None) in self.names or (host, port) in self.names

    def covers(self, address: IPAddress, port: int) -> bool:
        return any(address in net and want in (None, port) for net, want in self.networks)


def parse_allowed_hosts(entries: list[str]) -> AllowedHosts:
    """Entries `host`, `host:port`, `1.2.3.4`, `1.2.3.4:port`, `[::1]:port`, `10.0.0.0/8`; ValueError
    naming a bad one."""
    names: set[tuple[str, int | None]] = set()
    networks: list[tuple[IPNetwork, int | None]] = []
    for raw in entries:
        entry = raw.strip().lower()
        host, port = entry, None
        match = re.fullmatch(r"\[([0-9a-f:.]+)\](?::(\d{1,5}))?", entry)
        if match:
            host, port = match[1], int(match[2]) if match[2] else None
        elif entry.count(":") == 1:
            host, _, port_text = entry.partition(":")
            if not port_text.isdigit():
                raise ValueError(f"webhook allowed host {raw!r}: the port must be a number")
            port = int(port_text)
        if port is not None and not 0 < port < 65536:
            raise ValueError(f"webhook allowed host {raw!r}: the port must be 1-65535")
        try:
            networks.append((ipaddress.ip_network(host, strict=False), port))
            continue
        except ValueError:
            pass
        if "/" in host or not HOST_NAME.match(host):
            raise ValueError(
                f"webhook allowed host {raw!r} is not a host, host:port, IP address or CIDR network"
            )
        names.add((host.rstrip("."), port))
    return AllowedHosts(frozenset(names), tuple(networks))


def public_address(address: IPAddress) -> bool:
    """Whether `address` is on the public internet (an IPv4-mapped IPv6 address counts as its IPv4)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_global and not address.is_multicast


def address_kind(address: IPAddress) -> str:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    for kind in ("loopback", "link_local", "multicast", "unspecified", "reserved", "private"):
        if getattr(address, f"is_{kind}"):
            return kind.replace("_", "-")
    return "non-public"


@dataclass(frozen=True)
class Url:
    """A webhook URL split into what an attempt needs."""

    url: str
    scheme: str
    host: str
    port: int
    host_header: str  # the URL's host[:port], sent as `Host`
    target: str  # path and query


@dataclass(frozen=True)
class Target:
    """A checked URL and the address an attempt connects to."""

    url: Url
    address: IPAddress

    @property
    def pinned_url(self) -> str:
        """The URL with its host replaced by the checked address (`Host` and TLS SNI keep the name)."""
        host = f"[{self.address}]" if self.address.version == 6 else str(self.address)
        return f"{self.url.scheme}://{host}:{self.url.port}{self.url.target}"


def parse_url(url: str) -> Url:
    """Splits a webhook URL; `UrlRefused` for anything but `http(s)://host[:port]/path?query`."""
    if len(url) > MAX_URL_LENGTH:
        raise UrlRefused(f"must be at most {MAX_URL_LENGTH} characters")
    if any(c.isspace() or ord(c) < 32 for c in url):
        raise UrlRefused("must not contain spaces or control characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise UrlRefused(f"is not a valid URL ({exc})") from None
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS:
        raise UrlRefused("must be an https:// URL")
    if not parts.hostname:
        raise UrlRefused("must name a host")
    if parts.username is not None or parts.password is not None:
        raise UrlRefused("must not carry credentials (user:password@); verify the signature instead")
    if parts.fragment:
        raise UrlRefused("must not have a #fragment")
    host = parts.hostname.lower().rstrip(".")
    netloc = parts.netloc.lower()
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return Url(url, scheme, host, port or DEFAULT_PORTS[scheme], netloc, target)


def check(url: Url, addresses: list[IPAddress], allowed: AllowedHosts) -> Target:
    """The target to connect to, if `url` resolving to `addresses` may receive webhooks."""
    if not addresses:
        raise Unresolvable(f"host {url.host!r} resolves to no address")
    named = allowed.names_host(url.host, url.port)
    if not named:
        for address in addresses:
            if not public_address(address) and not allowed.covers(address, url.port):
                raise UrlRefused(
                    f"host {url.host!r} resolves to {address}, a {address_kind(address)} address: "
                    "webhooks go to public addresses only (the operator may allow internal receivers: "
                    f"{ALLOW_SETTING})"
                )
    opened = named or all(allowed.covers(address, url.port) for address in addresses)
    if url.scheme != "https" and not opened:
        raise UrlRefused(
            f"must be an https:// URL (http only for receivers the operator allows: {ALLOW_SETTING})"
        )
    return Target(url, addresses[0])


def _addresses(infos: list[tuple[object, ...]]) -> list[IPAddress]:
    found: list[IPAddress] = []
    for info in infos:
        sockaddr = info[4]
        assert isinstance(sockaddr, tuple)
        # An IPv6 sockaddr may carry a zone (`fe80::1%eth0`): the address is what comes before it.
        address = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
        if address not in found:
            found.append(address)
    return found


def vet(url: str, allowed: AllowedHosts) -> Target:
    """Parses, resolves (blocking: call it in a thread) and checks `url`."""
    parsed = parse_url(url)
    try:
        infos = socket.getaddrinfo(parsed.host, parsed.port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise Unresolvable(f"host {parsed.host!r} does not resolve ({exc})") from None
    return check(parsed, _addresses(list(infos)), allowed)


async def vet_async(url: str, allowed: AllowedHosts, timeout_s: float) -> Target:
    """`vet` on the event loop (the loop's resolver), bounded by `timeout_s`."""
    parsed = parse_url(url)
    loop = asyncio.get_running_loop()
    try:
        infos = await asyncio.wait_for(
            loop.getaddrinfo(parsed.host, parsed.port, type=socket.SOCK_STREAM), timeout_s
        )
    except (OSError, UnicodeError, TimeoutError) as exc:
        raise Unresolvable(f"host {parsed.host!r} does not resolve ({type(exc).__name__}: {exc})") from None
    return check(parsed, _addresses(list(infos)), allowed)
