"""HTTP connection policy of every FourSight client: the engine clients (bridge -> vLLM / SGLang)
and the rollout clients (trainer -> bridge).

* **Connect retries.** A refused or timed-out connect (a restarting engine or bridge, a full
  accept queue) is retried by the transport with backoff 0, 0.5, 1, 2, 4 s (7.5 s in all). httpx
  retries only a failed *connect*, so a request is never sent twice.
* **Keep-alive expiry below the servers'.** vLLM's, SGLang's and the bridge's uvicorn close a
  connection after 5 s idle (``--timeout-keep-alive``, ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``), which is
  also httpx's default client expiry: a request sent on a connection idle for just about 5 s can
  meet the server's close and fail with ``ReadError`` (connection reset) although the server is
  fine. The clients drop idle connections after 2 s instead, before the server does.
"""

from __future__ import annotations

import httpx

CONNECT_RETRIES = 5
KEEPALIVE_EXPIRY_S = 2.0


def limits(max_connections: int = 100) -> httpx.Limits:
    return httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections,
                        keepalive_expiry=KEEPALIVE_EXPIRY_S)


def transport(max_connections: int = 100) -> httpx.HTTPTransport:
    return httpx.HTTPTransport(retries=CONNECT_RETRIES, limits=limits(max_connections))


def async_transport(max_connections: int = 100) -> httpx.AsyncHTTPTransport:
    return httpx.AsyncHTTPTransport(retries=CONNECT_RETRIES, limits=limits(max_connections))
