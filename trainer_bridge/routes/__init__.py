"""The rollout bridge's HTTP routes, one module per subject (``server.create_app`` includes each router):

* :mod:`.rollouts` — ``POST /v1/rollouts`` and the one admission and sampling path every sampling route uses;
* :mod:`.weights` — ``POST /v1/weights`` (versioned weight update), ``GET /v1/weights``;
* :mod:`.health` — ``GET /v1/health`` (also ``/health``), ``GET /metrics``;
* :mod:`.openai` — ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``;
* :mod:`.trl` — TRL's vLLM-server routes (``/server_info``, ``/update_weights``, ...).

The state they share (engines, version gate, metrics, limits) is one :class:`.state.BridgeState`
on ``app.state.bridge``, which each route receives through the FastAPI dependency
:func:`.state.bridge_state`.
"""
