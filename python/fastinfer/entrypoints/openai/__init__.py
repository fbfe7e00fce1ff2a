"""The OpenAI-compatible HTTP server (``fastinfer serve``): :mod:`.protocol` (request bodies, the
error shape), :mod:`.serving` (limits, sampling params, engine requests, SSE), :mod:`.serving_completion`
and :mod:`.serving_chat` (the two generation endpoints), :mod:`.metrics` (Prometheus), :mod:`.api_server`
(the app, its guard, uvicorn). Needs ``fastapi``, ``uvicorn`` and ``prometheus_client``."""
