"""``--engines`` and ``--engine-url``: which engines ``foursight compare`` runs, and the learner."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from foursight.precisions import PRECISIONS
from foursight.trainer_bridge.backends.registry import ENGINE_KINDS, EngineKind, EngineKindError, engine_kind, kinds_for

#: precisions that only an in-process engine serves here (compare quantizes the model in this process; fp8:
#: foursight.fp8)
IN_PROCESS_ONLY = ("fp8",)
#: the engine kinds ``--engines`` takes (the registry's, trainer_bridge.backends.registry)
KINDS = kinds_for("compare")
LEARNER = "hf:bf16"


class CompareError(ValueError):
    """Bad ``compare`` arguments (names the flag)."""


@dataclass(frozen=True)
class EngineSpec:
    kind: str
    precision: str

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.precision}"

    @property
    def row(self) -> EngineKind:
        """The kind's row of the engine registry."""
        return ENGINE_KINDS[self.kind]

    @classmethod
    def parse(cls, s: str) -> "EngineSpec":
        kind, _, prec = s.strip().partition(":")
        if prec not in PRECISIONS or kind not in ENGINE_KINDS:
            raise CompareError(f"--engines: {s!r} is not KIND:PRECISION with KIND in {KINDS} and PRECISION in {PRECISIONS}")
        try:
            row = engine_kind(kind, "compare", "--engines")
        except EngineKindError as e:
            raise CompareError(str(e)) from None
        if prec in IN_PROCESS_ONLY and row.in_process is None:
            local = [ENGINE_KINDS[k] for k in KINDS if ENGINE_KINDS[k].in_process]
            raise CompareError(f"--engines: {s!r}: {prec} rollouts are served by the in-process {' or '.join(r.title for r in local)} "
                               f"engine only ({', '.join(f'{r.name}:{prec}' for r in local)}; "
                               f"foursight.fp8, torch._scaled_mm on CUDA, the dequantized reference on CPU)")
        return cls(kind, prec)


def parse_engines(spec: str) -> list[EngineSpec]:
    out = [EngineSpec.parse(s) for s in spec.split(",") if s.strip()]
    if not out:
        raise CompareError("--engines: no engine given")
    if len({e.name for e in out}) != len(out):
        raise CompareError(f"--engines: repeated engine in {spec!r}")
    return out


def parse_engine_urls(items: Sequence[str]) -> dict[str, str]:
    urls = {}
    for it in items:
        name, eq, url = it.partition("=")
        if not eq or not url.startswith("http"):
            raise CompareError(f"--engine-url: {it!r} is not KIND:PRECISION=http://HOST:PORT")
        spec = EngineSpec.parse(name)
        if spec.row.server is None:
            servers = [k for k in KINDS if ENGINE_KINDS[k].server]
            raise CompareError(f"--engine-url {it}: the {spec.kind} engine runs in this process; only {' and '.join(servers)} "
                               "servers are reached by URL")
        urls[spec.name] = url.rstrip("/")
    return urls
