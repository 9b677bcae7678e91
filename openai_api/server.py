"""The HTTP server: uvicorn serving the app on the serve process's event loop, beside the gRPC server.

uvicorn's own signal handling is off: `specpool serve` owns SIGINT/SIGTERM and stops both servers. With `tls.cert`
set it speaks HTTPS with the deployment's certificate, as the gRPC ports speak TLS, and with `tls.client_auth` it
asks for a client certificate signed by `tls.ca` (mutual TLS)."""
from __future__ import annotations

import asyncio
import contextlib
import os
import ssl

import uvicorn

from router.addresses import cannot_listen, port_taken
from settings.schema import TlsConfig


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield


class HttpServer:
    """Start with `await start()` (returns the bound port), stop with `await stop(grace)`."""

    def __init__(self, app, host: str, port: int, tls: TlsConfig | None = None):
        self._app = app
        self._server = _EmbeddedServer(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                                      access_log=False, lifespan="off", **https(tls)))
        self._task: asyncio.Task | None = None

    async def start(self) -> int:
        host, port = self._server.config.host, self._server.config.port
        if port and port_taken(host, port):          # before uvicorn, which logs a line of its own as it fails
            raise OSError(cannot_listen("http.port", host, port))
        self._task = asyncio.get_running_loop().create_task(self._serve())
        while not self._server.started:
            if self._task.done():
                raise OSError(cannot_listen("http.port", host, port))
            await asyncio.sleep(0.01)
        return self._server.servers[0].sockets[0].getsockname()[1]

    async def _serve(self) -> None:
        try:
            await self._server.serve()
        except SystemExit:            # uvicorn exits when it cannot bind; that must not end the event loop
            pass

    async def stop(self, grace: float) -> None:
        """Stop accepting, give open requests `grace` seconds, then close them (the app's own work first: its
        `state.stopping`, if any, ends the background responses still running)."""
        if self._task is None:
            return
        stopping = getattr(self._app.state, "stopping", None)
        if stopping is not None:
            await stopping()
        self._server.config.timeout_graceful_shutdown = max(grace, 0.05)   # at 0 uvicorn logs an error, always
        self._server.should_exit = True
        await asyncio.gather(self._task, return_exceptions=True)


def https(tls: TlsConfig | None) -> dict:
    """uvicorn's TLS settings for `tls` (none while tls.cert is unset): the deployment's certificate, and under
    tls.client_auth a client certificate required, signed by tls.ca."""
    if tls is None or not tls.enabled:
        return {}
    path = os.path.expanduser
    settings = {"ssl_certfile": path(tls.cert), "ssl_keyfile": path(tls.key)}
    if tls.client_auth:
        settings.update(ssl_ca_certs=path(tls.ca), ssl_cert_reqs=ssl.CERT_REQUIRED)
    return settings
