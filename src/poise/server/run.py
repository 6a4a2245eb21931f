"""Running a replica under uvicorn with a graceful drain on SIGTERM.

uvicorn's own SIGTERM handling closes the listening socket at once, so a request arriving during
shutdown gets a connection refused instead of an answer a client or load balancer can act on.
poise keeps listening while it drains: readiness turns false, new requests get 503, in-flight
ones finish up to the drain timeout and the rest end with an explicit error; then uvicorn shuts
down and the process exits 0. A second SIGTERM or SIGINT exits at once. If the model cannot load
or the engine dies, the process exits 1 so a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from types import FrameType

import uvicorn

from poise.asgi import uvicorn_config
from poise.config import ServerSettings
from poise.observability.logs import configure_logging
from poise.server.app import EngineLoader, ServerState, create_app, load_engine

log = logging.getLogger("poise.server")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        state.on_fatal = self.fatal

    async def serve(self, sockets: list | None = None) -> None:  # type: ignore[type-arg]
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)
        self._captured_signals.clear()  # exit with our code, not by re-raising the signal

    def fatal(self, reason: str) -> None:
        log.error("exiting: %s", reason)
        self.exit_code = 1
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        replica = self.state.replica
        if sig != signal.SIGTERM or self._draining or replica is None or self._loop is None:
            if self._draining:
                self.force_exit = True
            self.should_exit = True
            return
        self._draining = True
        timeout = self.state.settings.drain_timeout_s
        log.info("SIGTERM: draining for up to %.1fs", timeout)

        async def drain() -> None:
            try:
                await replica.drain(timeout)
            finally:
                self.should_exit = True

        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(drain()))  # type: ignore[union-attr]


def serve(settings: ServerSettings, loader: EngineLoader = load_engine) -> int:
    # The engine thread runs Python between its torch calls; at the default 5 ms switch interval
    # the HTTP loop can wait that long for the interpreter, which shows in every refusal's and
    # probe's latency. 1 ms hands it over sooner at a small cost to step time.
    sys.setswitchinterval(0.001)
    configure_logging(settings.log_level, settings.log_levels, settings.log_format)
    app = create_app(settings, loader)
    config = uvicorn_config(app, settings.host, settings.port, settings.log_level)
    server = DrainingServer(config, app.state.poise)
    server.run()
    return server.exit_code
