"""gRPC credentials from the `tls:` config section, for servers (public and workers) and for the
router's channels to its workers."""
from __future__ import annotations

from pathlib import Path

import grpc

from settings.schema import TlsConfig


def _read(path: str) -> bytes | None:
    return Path(path).expanduser().read_bytes() if path else None


def server_credentials(tls: TlsConfig, require_client_auth: bool) -> grpc.ServerCredentials | None:
    """None when TLS is off; else this deployment's certificate, checking clients against `ca`
    when require_client_auth."""
    if not tls.enabled:
        return None
    return grpc.ssl_server_credentials([(_read(tls.key), _read(tls.cert))], root_certificates=_read(tls.ca),
                                       require_client_auth=require_client_auth)


def worker_server_credentials(tls: TlsConfig) -> grpc.ServerCredentials | None:
    """Workers take only the router, over mutual TLS, when internal TLS is on."""
    return server_credentials(tls, require_client_auth=True) if tls.internal else None


def worker_channel(address: str, tls: TlsConfig | None, options: list) -> grpc.aio.Channel:
    """The router's channel to a worker: mutual TLS when internal TLS is on, else plaintext."""
    if tls is None or not (tls.enabled and tls.internal):
        return grpc.aio.insecure_channel(address, options=options)
    credentials = grpc.ssl_channel_credentials(_read(tls.ca), _read(tls.key), _read(tls.cert))
    if tls.server_name:
        options = [*options, ("grpc.ssl_target_name_override", tls.server_name)]
    return grpc.aio.secure_channel(address, credentials, options=options)
