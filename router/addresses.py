"""gRPC addresses from the config's host and port keys: an IPv6 literal goes in brackets (`[::1]:50052`), and a
client dials a server bound to a wildcard on loopback."""
from __future__ import annotations

import ipaddress

from settings.schema import WILDCARD_HOSTS


def host_port(host: str, port: int) -> str:
    """`host:port` as gRPC reads it: "[::1]:50052" for an IPv6 literal (bracketed or not), else "host:port"."""
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        if ipaddress.ip_address(bare).version == 6:
            return f"[{bare}]:{port}"
    except ValueError:          # a name (localhost, router.internal) or an IPv4 address
        pass
    return f"{host}:{port}"


def dial(host: str, port: int) -> str:
    """Where a client on this host reaches a server bound to host:port."""
    return host_port("127.0.0.1" if host in WILDCARD_HOSTS else host, port)
