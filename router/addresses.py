"""gRPC addresses from the config's host and port keys: an IPv6 literal goes in brackets (`[::1]:50052`), and a
client dials a server bound to a wildcard on loopback."""
from __future__ import annotations

import errno
import ipaddress
import socket

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


def cannot_listen(key: str, host: str, port: int) -> str:
    """The one line a listener that could not bind its port says, naming the config key that set it."""
    return (f"{key} = {port}: cannot listen on {host_port(host, port)} (in use, not allowed, or not an address of "
            f"this host)")


def port_taken(host: str, port: int) -> bool:
    """Whether host:port is in use or not ours to bind (EADDRINUSE, EACCES), found by binding it as gRPC would (with
    SO_REUSEADDR), so that a server refuses it in its own words before gRPC's core fails it with a log line of its
    own. Other failures (an address this host lacks, a name that does not resolve) are left to the bind itself."""
    try:
        for family, kind, proto, _, address in socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM,
                                                                  flags=socket.AI_PASSIVE):
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(address)
    except OSError as exc:
        return exc.errno in (errno.EADDRINUSE, errno.EACCES)
    return False


def dial(host: str, port: int) -> str:
    """Where a client on this host reaches a server bound to host:port."""
    return host_port("127.0.0.1" if host in WILDCARD_HOSTS else host, port)
