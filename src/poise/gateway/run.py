"""Running the gateway under uvicorn."""

from __future__ import annotations

import uvicorn

from poise.asgi import uvicorn_config
from poise.gateway.app import create_gateway_app
from poise.gateway.config import GatewaySettings


def serve_gateway(settings: GatewaySettings) -> int:
    app = create_gateway_app(settings)
    uvicorn.Server(uvicorn_config(app, settings.host, settings.port, settings.log_level)).run()
    return 0
