"""The HTTP server: uvicorn serving the app on the serve process's event loop, beside the gRPC server.

uvicorn's own signal handling is off: `specpool serve` owns SIGINT/SIGTERM and stops both servers."""
from __future__ import annotations

import asyncio
import contextlib

import uvicorn

from router.addresses import cannot_listen, port_taken


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield


class HttpServer:
    """Start with `await start()` (returns the bound port), stop with `await stop(grace)`."""

    def __init__(self, app, host: str, port: int):
        self._server = _EmbeddedServer(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                                      access_log=False, lifespan="off"))
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
        """Stop accepting, give open requests `grace` seconds, then close them."""
        if self._task is None:
            return
        self._server.config.timeout_graceful_shutdown = grace
        self._server.should_exit = True
        await asyncio.gather(self._task, return_exceptions=True)
