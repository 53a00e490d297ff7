"""What every ``foursight`` verb shares: one error style.

A verb's function is wrapped in :func:`guarded`: a user error (a bad option, a bad checkpoint, a
missing file: :class:`ValueError` and its subclasses such as ``CheckpointError``, ``NVFP4Error``,
:class:`OptionError`; ``FileNotFoundError``/``FileExistsError``; ``RuntimeError`` from an engine
that would not start) is printed as ``error: <message>`` and the command exits with status 2.
"""

from __future__ import annotations

import functools
from typing import Callable, NoReturn, TypeVar

import typer

F = TypeVar("F", bound=Callable)

USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, RuntimeError)


class OptionError(ValueError):
    """A bad command-line option; the message names the flag."""


def fail(msg: str) -> NoReturn:
    """Print ``error: msg`` and exit with status 2."""
    from rich.console import Console

    Console(soft_wrap=True).print(f"[bold red]error:[/] {msg}", highlight=False)
    raise typer.Exit(2)


def guarded(fn: F) -> F:
    """Run a verb; turn a user error into :func:`fail`."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except USER_ERRORS as e:
            fail(str(e))

    return run  # type: ignore[return-value]
