"""Options of one rollout bridge: :class:`BridgeConfig`, written once.

The flags of ``foursight bridge serve`` are generated from it (:func:`foursight.cli_config.typer_command`, as
``compare``, ``rl`` and ``quantize`` do), and the same object goes to ``server.serve``, ``server.create_app``
and the routes' ``BridgeState``; the library's keyword arguments (``create_app(api_key=..., sample_timeout_s=...)``)
are its field names. Light imports only: the CLI reads this module without the server stack.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from foursight.cli_config import option
from foursight.trainer_bridge.backends.registry import kinds_for
from foursight.trainer_bridge.protocol import DEFAULT_WRITE_TIMEOUT_S


@dataclass
class BridgeConfig:
    """Options of one bridge (the flags of ``foursight bridge serve``; each field's help is its flag's help).

    The engines are made from ``engine`` .. ``device`` and ``weight_sync`` (:func:`foursight.trainer_bridge.cli.build_engines`,
    after :func:`~foursight.trainer_bridge.cli.check_options`); the app (``create_app``) reads the rest."""

    engine: str = option("vllm", help=" | ".join(kinds_for("bridge")))
    engine_urls: list[str] = option(default_factory=list, flag="--engine-url", help="engine server URL (repeat for several engines)")
    model: Optional[Path] = option(None, help="model folder (hf engine; also the tokenizer by default)")
    tokenizer: Optional[Path] = option(None, help="tokenizer folder for text/chat prompts")
    host: str = option("127.0.0.1", help="bind address (loopback by default)")
    port: int = option(8100, min=1, max=65535)
    api_key: Optional[str] = option(None, envvar="FOURSIGHT_BRIDGE_API_KEY",
                                    help="required on /v1/rollouts and /v1/weights (header Authorization: Bearer KEY)")
    engine_api_key: Optional[str] = option(None, envvar="FOURSIGHT_ENGINE_API_KEY")
    max_concurrency: int = option(64, min=1, help="engine calls in flight at once")
    max_queue: int = option(256, min=1, help="per-stream window: samples of one stream running or finished-but-unsent (backpressure)")
    sample_timeout_s: float = option(600.0, flag="--sample-timeout", min=0.001, help="seconds per sample before an error event")
    write_timeout_s: float = option(DEFAULT_WRITE_TIMEOUT_S, flag="--write-timeout", min=0.001,
                                    help="seconds one response write may wait for a client that stopped reading; then the "
                                         "response is dropped (its engine calls cancelled, its hold on weight updates released)")
    logprobs_mode: Optional[str] = option(None, help="what the engine's logprobs are: raw_logprobs | processed_logprobs")
    initial_version: int = option(0, min=0)
    device: str = option("cpu", help="hf engine device")
    allow_remote: bool = option(False, help="allow a non-loopback --host (requires --api-key)")
    weights_dirs: Optional[list[Path]] = option(None, flag="--weights-dir",
                                                help="folder a weight update path must lie in (repeat for several; none: any path, "
                                                     "with a warning)")
    allowed_hosts: list[str] = option(default_factory=list, flag="--allowed-host",
                                      help="Host/Origin name accepted besides loopback and --host (repeat; '*.example.com' patterns)")
    max_body_bytes: int = option(32 << 20, min=1024, help="request body limit (413 beyond it)")
    max_upload_bytes: Optional[int] = option(None, min=1, help="largest weight upload (PUT /v1/weights/uploads/NAME; 413 beyond it); "
                                                               "default: the model's BF16 size from the --model/--tokenizer folder "
                                                               "plus 16 MiB of headers (256 GiB when that folder has no safetensors)")
    max_uploads_bytes: Optional[int] = option(None, min=1, help="all weight uploads kept at once, partial and complete (413 beyond "
                                                                "it); default: twice --max-upload-bytes")
    upload_ttl_s: float = option(900.0, flag="--upload-ttl", min=0.001,
                                 help="seconds an upload may go without a chunk, or complete without being applied, before it is removed")
    max_tokens_cap: Optional[int] = option(None, min=1, help="largest max_tokens a request may ask for")
    max_request_tokens: Optional[int] = option(None, min=1, help="per-request token budget: n times the sum of the prompts' max_tokens")
    wait: float = option(300.0, min=0.0, help="seconds to wait for every --engine-url to answer /health before serving (an engine "
                                               "still loading its model), then each is checked once (its model and weight "
                                               "state read); 0: do not wait or check")
    weight_sync: str = option("collective_rpc",
                              help="vllm engine weight updates: collective_rpc (FourSight worker extension) or native "
                                   "(vLLM >= 0.32, --weight-transfer-config '{\"backend\": \"foursight_file\"}')")
    #: seconds the health probe (a 1-token request per engine) may take (not a flag)
    probe_timeout_s: float = 10.0
