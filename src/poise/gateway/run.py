"""Running the gateway under uvicorn."""

from __future__ import annotations

import uvicorn

from poise.asgi import uvicorn_config
from poise.gateway.app import create_gateway_app
from poise.gateway.config import GatewaySettings
from poise.observability.logs import configure_logging


def serve_gateway(settings: GatewaySettings) -> int:
    configure_logging(settings.log_level, settings.log_levels, settings.log_format)
    app = create_gateway_app(settings)
    uvicorn.Server(uvicorn_config(app, settings.host, settings.port, settings.log_level)).run()
    return 0
