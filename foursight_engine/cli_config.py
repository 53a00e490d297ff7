"""Options written once: a verb's config dataclass generates its command-line flags.

A verb whose options are a dataclass (``CompareConfig``, ``RLConfig``) declares each option once, as a
field with its default and its help (:func:`option`). :func:`typer_command` turns the dataclass into the
function Typer reads: one ``--flag`` per field (the field name with ``-`` for ``_``), the field's type and
default, its help and bounds. The verb's body receives the filled-in config. This is what TRL does with
its config dataclasses and ``HfArgumentParser``; here Typer keeps the CLI's look and its error style.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from typing import Any, Callable, TypeVar

import typer

C = TypeVar("C")


def option(default: Any = dataclasses.MISSING, *, help: str = "", flag: str | None = None, typer_type: Any = None,
           default_factory: Any = dataclasses.MISSING, **typer_kw: Any) -> Any:
    """A config field that is also a command-line option.

    ``help`` is the flag's help text; ``flag`` overrides the generated ``--field-name``; ``typer_type`` the
    annotation Typer sees (e.g. an ``Annotated`` option shared by several verbs); ``typer_kw`` go to
    ``typer.Option`` (``min``, ``max``, ``envvar``, ...)."""
    meta = {"help": help, "flag": flag, "typer_type": typer_type, "typer_kw": typer_kw}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata={"cli": meta})
    return dataclasses.field(default=default, metadata={"cli": meta})


def cli_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of ``cls`` that are command-line options (declared with :func:`option`)."""
    return [f for f in dataclasses.fields(cls) if "cli" in f.metadata]


def flag_name(f: dataclasses.Field) -> str:
    return f.metadata["cli"]["flag"] or "--" + f.name.replace("_", "-")


def typer_command(cls: type[C], body: Callable[[C], Any], doc: str | None = None) -> Callable[..., Any]:
    """The function Typer registers as a verb: one keyword per option field of ``cls``; it builds ``cls`` from
    them and calls ``body(config)``."""
    hints = typing.get_type_hints(cls, include_extras=True)
    params, annotations = [], {}
    for f in cli_fields(cls):
        meta = f.metadata["cli"]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        ann = meta["typer_type"] if meta["typer_type"] is not None else hints[f.name]
        if typing.get_origin(ann) is typing.Annotated:  # a shared Annotated[..., typer.Option(...)] keeps its own flag/help
            value = default
        else:
            value = typer.Option(default, flag_name(f), help=meta["help"], **meta["typer_kw"])
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=value, annotation=ann))
        annotations[f.name] = ann

    def command(**kwargs: Any) -> Any:
        return body(cls(**kwargs))

    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__annotations__ = annotations
    command.__doc__ = doc if doc is not None else body.__doc__
    command.__name__ = getattr(body, "__name__", "command")
    return functools.update_wrapper(command, body, assigned=("__module__", "__qualname__"), updated=())
