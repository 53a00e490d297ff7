"""``--engines`` and ``--engine-url``: which engines ``foursight compare`` runs, and the learner."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from foursight.precisions import PRECISIONS

#: precisions that only the in-process HF engine serves here (fp8: foursight.fp8)
HF_ONLY = ("fp8",)
KINDS = ("hf", "vllm", "sglang")
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

    @classmethod
    def parse(cls, s: str) -> "EngineSpec":
        kind, _, prec = s.strip().partition(":")
        if kind not in KINDS or prec not in PRECISIONS:
            raise CompareError(f"--engines: {s!r} is not KIND:PRECISION with KIND in {KINDS} and PRECISION in {PRECISIONS}")
        if prec in HF_ONLY and kind != "hf":
            raise CompareError(f"--engines: {s!r}: {prec} rollouts are served by the in-process HF engine only (hf:{prec}; "
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
        if spec.kind == "hf":
            raise CompareError(f"--engine-url {it}: the hf engine runs in this process; only vllm and sglang servers are reached by URL")
        urls[spec.name] = url.rstrip("/")
    return urls
