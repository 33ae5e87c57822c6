"""The client address of a request: the peer, or what a trusted proxy says in ``X-Forwarded-For``.

``X-Forwarded-For`` is read only when the peer itself is a trusted proxy
(``XMARK_TRUSTED_PROXIES``: addresses or CIDR networks). Its entries are walked from the right (the
hop closest to the gateway) and the first one that is not a trusted proxy is the client: entries to
its left were written by the client or by proxies nobody vouches for, so they are never believed.
An entry that is not an address ends the walk at the last trusted hop before it.

Addresses are reduced to the bucket the per-address limits count by (:func:`address_bucket`): an
IPv4 address as it is, an IPv6 address by its network of ``ipv6_prefix`` bits (a /64 is what one
subscriber usually holds, and rotating addresses inside it is free), an IPv4-mapped IPv6 address as
its IPv4 address.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

UNKNOWN_CLIENT = "unknown"


def parse_address(text: str) -> IPAddress | None:
    """An address from a peer or an ``X-Forwarded-For`` entry (``[v6]:port`` and ``v4:port`` too)."""
    text = text.strip().strip('"')
    if text.startswith("["):  # [2001:db8::1]:443
        text = text[1:].partition("]")[0]
    elif text.count(":") == 1:  # 192.0.2.1:443
        text = text.partition(":")[0]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def parse_networks(entries: Iterable[str]) -> tuple[IPNetwork, ...]:
    """Trusted proxies from addresses or CIDR networks (``ValueError`` names a bad entry)."""
    networks = []
    for entry in entries:
        try:
            networks.append(ipaddress.ip_network(entry.strip(), strict=False))
        except ValueError:
            raise ValueError(f"not an IP address or network: {entry.strip()!r}") from None
    return tuple(networks)


def address_bucket(address: IPAddress, ipv6_prefix: int) -> str:
    """The key per-address limits count by: the IPv4 address, or the IPv6 network of ``ipv6_prefix`` bits."""
    if isinstance(address, ipaddress.IPv6Address) and ipv6_prefix < 128:
        return str(ipaddress.IPv6Network((address, ipv6_prefix), strict=False))
    return str(address)


@dataclass(frozen=True)
class ClientAddressResolver:
    """Resolves a request's client address bucket from its peer and ``X-Forwarded-For`` values."""

    trusted: tuple[IPNetwork, ...] = ()
    ipv6_prefix: int = 64
    # client addresses that per-address limits leave alone (``bucket`` is None for them)
    exempt: tuple[IPNetwork, ...] = ()

    def _trusted(self, address: IPAddress) -> bool:
        return any(address in network for network in self.trusted)

    def client(self, peer: str | None, forwarded_for: Sequence[str] = ()) -> IPAddress | None:
        """The client's address (None when the peer is not an IP address, e.g. a Unix socket)."""
        address = parse_address(peer) if peer else None
        if address is None or not self.trusted or not self._trusted(address):
            return address
        # every X-Forwarded-For header, in order, as one list (RFC 7230: same as one joined header)
        hops = [hop for value in forwarded_for for hop in value.split(",") if hop.strip()]
        for hop in reversed(hops):
            forwarded = parse_address(hop)
            if forwarded is None:
                return address  # the trusted hop that passed this garbage on is what we know
            address = forwarded
            if not self._trusted(address):
                return address
        return address  # every hop is a trusted proxy: the left-most one

    def bucket(self, peer: str | None, forwarded_for: Sequence[str] = ()) -> str | None:
        """The per-address limits' key of a request; None for an exempt client address."""
        address = self.client(peer, forwarded_for)
        if address is None:
            return peer or UNKNOWN_CLIENT
        if any(address in network for network in self.exempt):
            return None
        return address_bucket(address, self.ipv6_prefix)
