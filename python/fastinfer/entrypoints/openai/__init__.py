"""The OpenAI-compatible HTTP server (``fastinfer serve``): :mod:`.protocol` (request bodies, the
error shape), :mod:`.serving` (limits, sampling params, engine requests, SSE), :mod:`.serving_completion`
and :mod:`.serving_chat` (the two generation endpoints), :mod:`.metrics` (Prometheus), :mod:`.api_server`
(the app, its guard, uvicorn). Needs ``fastapi``, ``uvicorn`` and ``prometheus_client``: ``pip install 'fastinfer[serve]'``."""

from ..._optional import require

# the server's own packages, checked before any of its modules imports them
for _module in ("fastapi", "uvicorn", "prometheus_client"):
    require(_module, "serve", "fastinfer serve")
del _module

