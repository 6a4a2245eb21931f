"""Running the gateway under uvicorn."""

from __future__ import annotations

import logging
import sys

import uvicorn

from poise.gateway.app import create_gateway_app
from poise.gateway.config import GatewaySettings


def serve_gateway(settings: GatewaySettings) -> int:
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    sys.setswitchinterval(0.001)
    config = uvicorn.Config(
        create_gateway_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        timeout_graceful_shutdown=10,
        timeout_keep_alive=30,
    )
    uvicorn.Server(config).run()
    return 0
