"""What every ``foursight`` verb shares: one error style, and the options that mean the same in every verb.

A verb's function is wrapped in :func:`guarded`: a user error (a bad option, a bad checkpoint, a
missing file: :class:`ValueError` and its subclasses such as ``CheckpointError``, ``NVFP4Error``,
:class:`OptionError`; ``FileNotFoundError``/``FileExistsError``; ``RuntimeError`` from an engine
that would not start) is printed as ``error: <message>`` and the command exits with status 2.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Annotated, Callable, NoReturn, Optional, TypeVar

import typer

F = TypeVar("F", bound=Callable)

USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, RuntimeError)


class OptionError(ValueError):
    """A bad command-line option; the message names the flag."""


def fail(msg: str) -> NoReturn:
    """Print ``error: msg`` on standard error and exit with status 2."""
    from rich.console import Console

    Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {msg}", highlight=False)
    raise typer.Exit(2)


def check_port_free(host: str, port: int, flag: str = "--port") -> None:
    """Refuse (:class:`OptionError` naming ``flag``) a ``host:port`` a server could not bind because
    something already listens there, before the verb starts anything: a server that loads a model
    first would otherwise fail only after that (the bridge after its engine, 39 s; ``foursight serve``
    with a 30-line vLLM traceback after 46 s). Bound as uvicorn binds (``SO_REUSEADDR``), so a port
    that a closed server left in TIME_WAIT is not refused; a host that does not resolve is left to the
    server to report."""
    import errno
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return
    family, socktype, proto, _, addr = infos[0]
    with socket.socket(family, socktype, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise OptionError(f"{flag} {port}: {host}:{port} is already in use (another server listens there); "
                                  f"stop it or pick another {flag}") from None
            raise OptionError(f"{flag} {port}: cannot bind {host}:{port}: {e.strerror or e}") from None


def shown(path: str | Path) -> str:
    """A path a verb wrote, as it prints it: relative to the working folder when it lies inside it (``wrote
    out/smollm2-foursight``, also for ``--out out/x/../smollm2-foursight``), else absolute."""
    p = Path(path).absolute()
    try:
        return str(p.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)


def guarded(fn: F) -> F:
    """Run a verb; turn a user error into :func:`fail`."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except USER_ERRORS as e:
            fail(str(e))

    return run  # type: ignore[return-value]


def _check_channels(value: Optional[str]) -> Optional[str]:
    """``--channels`` is checked when the command line is read, before any model is loaded."""
    if value is not None:
        from foursight.schema import check_channel_spec

        try:
            check_channel_spec(value)
        except ValueError as e:
            fail(str(e))
    return value


#: The flags several verbs take, declared once so that each means one thing everywhere.
DEFAULT_CHANNELS = "32"
ModelOption = Annotated[Optional[str], typer.Option("--model", help="BF16 HF model folder, or a Hub id already in the local HF cache (no download); default: the packaged SmolLM2-135M-Instruct.")]
ChannelsOption = Annotated[str, typer.Option("--channels", callback=_check_channels, help="BF16 channels per input: a count (e.g. 128) or a percentage of K (e.g. 2%); 0 = plain NVFP4.")]
CalibOption = Annotated[Optional[Path], typer.Option("--calib", exists=True, dir_okay=False, readable=True, help="Calibration JSONL ({'text': ...} or {'messages': [...]} per line); default: built-in texts.")]
IgnoreOption = Annotated[list[str], typer.Option("--ignore", help="Modules kept unquantized (name, suffix or re:<regex>); repeatable.")]
