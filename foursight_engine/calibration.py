"""Calibration: the calibration texts and streaming per-input-channel activation statistics (the
choice of channels from them: :mod:`foursight.channels`).

The texts are a JSONL file (:func:`load_calibration_texts`) or the built-in set packaged with FourSight
(:func:`builtin_texts`: prose, code, math, chat, several languages), which also serves as prompts for
tests and benchmarks and as the corpus of the tiny models' tokenizer (:mod:`foursight.models`).

Statistics are kept in a mergeable form (count, mean, M2 — Chan et al.'s parallel Welford
update), in float64, per *input group*: linear layers that read the same activation tensor
(q/k/v, gate/up) share one group, and so do the gate/up projections of all experts of one MoE
layer. Forward pre-hooks on every ``nn.Linear`` collect them over a calibration set, ignoring
padding positions.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch
from torch import nn


_EXPERT_RE = re.compile(r"^(?P<prefix>.*\.experts)\.\d+\.(?P<proj>gate_proj|up_proj|w1|w3|down_proj|w2)$")


@dataclass
class ChannelStats:
    """Mergeable per-channel statistics of a [*, K] activation stream.

    Attributes:
        count: number of rows seen.
        mean: float64 [K].
        m2: float64 [K], sum of squared deviations from the mean.
        amax: float32 [K], max |x| per channel.
    """

    count: int
    mean: torch.Tensor
    m2: torch.Tensor
    amax: torch.Tensor

    @classmethod
    def empty(cls, k: int) -> "ChannelStats":
        z = torch.zeros(k, dtype=torch.float64)
        return cls(0, z.clone(), z.clone(), torch.zeros(k, dtype=torch.float32))

    @classmethod
    def from_rows(cls, x: torch.Tensor) -> "ChannelStats":
        """Statistics of rows ``x`` [R, K] (any float dtype)."""
        xd = x.detach().to(torch.float64)
        n = xd.shape[0]
        if n == 0:
            return cls.empty(xd.shape[1])
        mean = xd.mean(0)
        m2 = ((xd - mean) ** 2).sum(0)
        return cls(n, mean, m2, x.detach().abs().amax(0).float())

    def merge(self, other: "ChannelStats") -> "ChannelStats":
        """Combine two disjoint streams (Chan et al.): exact, order-independent up to rounding."""
        if other.count == 0:
            return self
        if self.count == 0:
            return other
        n = self.count + other.count
        delta = other.mean - self.mean
        mean = self.mean + delta * (other.count / n)
        m2 = self.m2 + other.m2 + delta**2 * (self.count * other.count / n)
        return ChannelStats(n, mean, m2, torch.maximum(self.amax, other.amax))

    def update(self, x: torch.Tensor) -> "ChannelStats":
        """Return the statistics after also seeing rows ``x`` [R, K]."""
        return self.merge(ChannelStats.from_rows(x))

    def fp4_amax(self, channels: torch.Tensor) -> float:
        """max |x| over the channels *not* in ``channels``: the amax of the FP4 part of the input,
        from which a static ``input_global_scale`` is made (the BF16 channels are zeroed before
        quantization, :func:`foursight.layer.quantize_activation`)."""
        rest = self.amax.clone()
        if channels.numel():
            rest[channels.long()] = 0
        return float(rest.amax()) if rest.numel() else 0.0

    @property
    def variance(self) -> torch.Tensor:
        """Population variance per channel, float64 [K] (zeros before any row is seen)."""
        return self.m2 / max(self.count, 1)


@dataclass
class InputGroup:
    """Linear layers that read one activation, with that activation's statistics.

    Attributes:
        key: a stable name (the first member's name, or ``<layer>.experts.gate_up`` for MoE).
        members: module names in model order.
        stats: :class:`ChannelStats` of the shared input.
        rows: up to ``keep_rows`` sample rows [R, K] (bf16) for error estimates.
    """

    key: str
    members: list[str]
    stats: ChannelStats
    rows: torch.Tensor | None = None
    _row_chunks: list = field(default_factory=list, repr=False)

    @property
    def in_features(self) -> int:
        return int(self.stats.mean.numel())


def group_key(name: str) -> str | None:
    """Name-based group for MoE experts (``...experts.<i>.gate_proj`` → ``...experts.gate_up``), else None."""
    m = _EXPERT_RE.match(name)
    if not m:
        return None
    kind = "down" if m.group("proj") in ("down_proj", "w2") else "gate_up"
    return f"{m.group('prefix')}.{kind}"


class StatsCollector:
    """Forward pre-hooks on linear layers that accumulate :class:`InputGroup` statistics.

    Use as a context manager around forward passes; call :meth:`set_mask` with the batch's
    attention mask before each forward so that padding rows are skipped.
    """

    def __init__(self, model: nn.Module, modules: list[str], keep_rows: int = 256, seed: int = 0):
        self.model = model
        self.module_names = list(modules)
        self.keep_rows = keep_rows
        self._gen = torch.Generator().manual_seed(seed)
        self._mask: torch.Tensor | None = None
        self._handles: list = []
        self._member_group: dict[str, str] = {}
        self.groups: dict[str, InputGroup] = {}
        # id(input) -> (input, group key) for the current forward pass; the tensor is held so
        # that its id cannot be reused by another tensor within the pass.
        self._seen_this_pass: dict[int, tuple[torch.Tensor, str]] = {}

    def set_mask(self, attention_mask: torch.Tensor | None) -> None:
        self._mask = None if attention_mask is None else attention_mask.reshape(-1).bool()
        self._seen_this_pass = {}

    def __enter__(self) -> "StatsCollector":
        mods = dict(self.model.named_modules())
        for name in self.module_names:
            self._handles.append(mods[name].register_forward_pre_hook(self._hook(name)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for g in self.groups.values():
            if g._row_chunks:
                rows = torch.cat(g._row_chunks)
                if rows.shape[0] > self.keep_rows:
                    idx = torch.randperm(rows.shape[0], generator=self._gen)[: self.keep_rows]
                    rows = rows[idx.sort().values]
                g.rows = rows
                g._row_chunks = []

    def _hook(self, name: str):
        def hook(module, args):
            x = args[0]
            self._record(name, x)

        return hook

    def _record(self, name: str, x: torch.Tensor) -> None:
        k = x.shape[-1]
        flat = x.detach().reshape(-1, k)
        if self._mask is not None and self._mask.numel() == flat.shape[0]:
            flat = flat[self._mask.to(flat.device)]
        gkey = self._member_group.get(name)
        if gkey is None:
            seen = self._seen_this_pass.get(id(x))
            gkey = group_key(name) or (seen[1] if seen is not None and seen[0] is x else None) or name
            self._member_group[name] = gkey
            grp = self.groups.get(gkey)
            if grp is None:
                self.groups[gkey] = InputGroup(gkey, [name], ChannelStats.empty(k))
            elif name not in grp.members:
                grp.members.append(name)
        self._seen_this_pass.setdefault(id(x), (x, gkey))
        grp = self.groups[gkey]
        if group_key(name) is None and grp.members[0] != name:
            return  # same tensor already recorded by the group's first member in this pass
        grp.stats = grp.stats.update(flat.float().cpu())
        take = min(flat.shape[0], max(self.keep_rows // 4, 16))
        if take:
            idx = torch.randperm(flat.shape[0], generator=self._gen)[:take]
            grp._row_chunks.append(flat[idx].to(torch.bfloat16).cpu())


def read_jsonl(path: str | Path):
    """``(line number, object)`` of each non-blank line of a JSONL file; FileNotFoundError or
    ValueError names ``path`` when it is missing or cannot be read, and ``path:line`` for invalid
    JSON or a line that is not an object."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ValueError(f"{path} is a folder, not a JSONL file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read it as UTF-8 text ({e})") from None
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not valid JSON ({e.msg})") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{path}:{i}: expected a JSON object")
        yield i, rec


def builtin_texts() -> list[str]:
    """The built-in calibration / prompt texts (diverse: prose, code, math, chat, several languages)."""
    path = resources.files("foursight").joinpath("data/calib_default.jsonl")
    return [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def load_calibration_texts(path: str | Path | None) -> list[str]:
    """Texts from a JSONL file (``{"text": ...}`` or ``{"messages": [...]}`` per line), or the built-ins."""
    if path is None:
        return builtin_texts()
    texts: list[str] = []
    for i, rec in read_jsonl(path):
        if isinstance(rec.get("text"), str):
            texts.append(rec["text"])
        elif isinstance(rec.get("messages"), list):
            texts.append("\n".join(f"{m.get('role', '')}: {m.get('content', '')}" for m in rec["messages"]))
        else:
            raise ValueError(f"{path}:{i}: expected an object with a 'text' string or a 'messages' list")
    if not texts:
        raise ValueError(f"{path}: no calibration texts found")
    return texts


def check_calibration_batches(batch_size: int, max_length: int) -> None:
    """``--batch-size`` and ``--max-length`` of calibration must be ≥ 1 (ValueError naming the flag)."""
    for flag, v in (("--batch-size", batch_size), ("--max-length", max_length)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{flag} {v!r}: must be an integer >= 1 (texts per calibration batch / tokens per text)")


@torch.no_grad()
def collect_stats(
    model: nn.Module,
    tokenizer,
    texts: list[str],
    modules: list[str],
    batch_size: int = 8,
    max_length: int = 256,
    keep_rows: int = 512,
    progress: bool = True,
) -> dict[str, InputGroup]:
    """Run ``texts`` through ``model`` in batches and return the input groups of ``modules``.

    Args:
        model: an HF causal LM (any device; stats are kept on CPU in float64).
        tokenizer: its tokenizer (padding is masked out of the statistics).
        texts: calibration texts.
        modules: names of the linear layers to observe.
    Returns:
        dict group key → :class:`InputGroup`, in model order.
    """
    from tqdm.auto import tqdm

    check_calibration_batches(batch_size, max_length)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    device = next(model.parameters()).device
    col = StatsCollector(model, modules, keep_rows=keep_rows)
    batches = [texts[i : i + batch_size] for i in range(0, len(texts), batch_size)]
    with col:
        for batch in tqdm(batches, desc="calibrating", unit="batch", disable=not progress):
            enc = tokenizer(batch, return_tensors="pt", padding=True, truncation=True, max_length=max_length)
            enc = {k: v.to(device) for k, v in enc.items()}
            col.set_mask(enc.get("attention_mask"))
            model(**enc)
    order = {n: i for i, n in enumerate(modules)}
    return dict(sorted(col.groups.items(), key=lambda kv: order.get(kv[1].members[0], 1 << 30)))
