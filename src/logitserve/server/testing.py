"""An in-process server on a background event loop, for tests and notebooks.

    with ServerThread(ServerConfig(port=0, host="127.0.0.1", device="cpu")) as server:
        with Client(server.target) as client:
            client.sample(logits)
        server.service.batcher.launches      # the live service object

The server's loop runs in its own thread, so blocking clients in the calling thread (or many
threads) talk to it as to a remote server; :meth:`ServerThread.run` runs a coroutine on that
loop (``server.run(server.service.stop(1))``).
"""

from __future__ import annotations

import asyncio
import threading

from .app import Service, create_server
from .config import ServerConfig


class ServerThread:
    """Starts ``create_server(config)`` on a private event loop thread; ``warm_up`` runs warm-up
    before returning (else health stays NOT_SERVING until ``run(service.warm_up())``)."""

    def __init__(self, config: ServerConfig, *, warm_up: bool = True, start_timeout: float = 300.0):
        self.config = config
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="logitserve-test-server", daemon=True)
        self._thread.start()
        self.service: Service | None = None
        try:
            self.service, self.port = self.run(self._create(), timeout=start_timeout)
            self.run(self.service.start(), timeout=start_timeout)
            if warm_up:
                self.run(self.service.warm_up(), timeout=start_timeout)
        except BaseException:
            self.close()
            raise

    async def _create(self) -> tuple[Service, int]:
        return create_server(self.config)  # on the server's loop: grpc.aio binds to it

    @property
    def target(self) -> str:
        host = self.config.host if self.config.host not in ("0.0.0.0", "::", "[::]") else "127.0.0.1"
        return f"{host}:{self.port}"

    def run(self, coro, timeout: float | None = 60.0):
        """Run ``coro`` on the server's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self, grace: float = 0.0) -> None:
        if self.service is not None:
            self.run(self.service.stop(grace), timeout=grace + 60)
            self.service = None
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=30)
        if not self.loop.is_running():
            self.loop.close()

    def __enter__(self) -> "ServerThread":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
