"""The per-layer plan shared by the vLLM and SGLang adapters: parameters, loaders, processing, forward.

Nothing here imports an engine. An engine adapter (``vllm_method.py``, ``sglang_method.py``, both
built on :class:`foursight.quant_methods.config.FourSightMethodConfig`) does four thin things and
calls this module for everything else:

1. **create_weights**: build a :class:`LayerPlan` (``LayerPlan.for_layer``), then for each
   :class:`ParamSpec` of ``plan.param_specs(params_dtype)`` register a parameter of that shape /
   dtype with the spec's ``attrs`` (``input_dim``/``output_dim``/``packed_dim``/``packed_factor``)
   and the loader ``plan.make_loader(spec, engine_loader)`` (``engine_loader`` is the layer's own
   column/row/QKV/merged loader; the plan wraps it with dtype checks, error messages that name
   the checkpoint tensor, and bookkeeping of what was loaded).
2. **process_weights_after_loading**: ``layer.foursight_state = plan.process(params, tp)`` where
   ``params`` maps the spec names to the layer's (unchanged) parameters. It is *idempotent*: it
   never modifies or replaces the loaded parameters, it rebuilds the execution state from them
   every time (so a second call, or a call after a weight reload, cannot double-apply a
   transform -- the class of bug of sglang#30761 / verl#7519).
3. **apply**: ``apply_linear(layer.foursight_state, x, bias)`` → the layer's
   :class:`foursight.dispatch.PreparedLinear` (SpliceGEMM on CUDA, the PyTorch reference on
   CPU; the backend is chosen once, in ``process``).
4. **TP**: pass a :class:`TPContext` whose collectives are the engine's (identity at TP=1).

Two load modes (``LayerPlan.mode``):

* ``"checkpoint"``: a FourSight checkpoint. Parameters per fused layer, derived from the
  checkpoint format's table (``schema.expected_shapes``; N = sum of the local
  output shards, K_loc = the local input size, k = BF16 channels, S = number of shards, e.g.
  3 for q/k/v):

  ============================  ====================  ===========  ===================================
  name                          shape                 dtype        loading
  ============================  ====================  ===========  ===================================
  ``weight_packed``             [N, K_loc/2]          uint8        engine loader (output_dim 0,
                                                                   input_dim 1, packed_dim 1, factor 2)
  ``weight_scale``              [N, K_loc/16]         float8_e4m3  engine loader (output_dim 0, input_dim 1)
  ``weight_bf16``               [N, k]                bfloat16     engine loader (output_dim 0; never
                                                                   split along K: kept whole, see TP)
  ``weight_global_scale``       [S]                   float32      per-shard row (``shard_id``)
  ``input_global_scale``        [S]                   float32      per-shard row
  ``bf16_channels``             [S, k]                int32        per-shard row; all rows must match
  ============================  ====================  ===========  ===================================

* ``"online"``: a BF16 checkpoint quantized at load (``--quantization foursight`` on a plain HF
  model, and the RL weight-update path). One parameter ``weight`` [N, K_loc] in the model dtype,
  loaded by the engine's loader; :meth:`LayerPlan.process` quantizes each shard with its own
  global scale and the shared channel set from a channels file or, failing that, the weight.

Fused layers: each shard keeps its own per-tensor ``weight_global_scale`` (as in the checkpoint);
the execution form gets a per-output-row vector (``QuantizedWeight.weight_global_scale`` [N]).
All shards of a fused layer share one input, so they must have identical ``bf16_channels``; a
mismatch is a :class:`~foursight.schema.CheckpointError` naming the layer.

Tensor parallelism:

* column-parallel layers (q/k/v, gate/up) split N: nothing special, every rank keeps all k
  channels and the rows of ``weight_bf16`` of its N shard;
* row-parallel layers (o_proj, down_proj) split K: rank r holds K columns
  ``[r*K_loc, (r+1)*K_loc)``; it keeps only the BF16 channels that fall into its K shard,
  re-indexed locally (``localize_channels``), and the matching columns of ``weight_bf16``. The
  global scales stay shared (they are per tensor). The rank outputs sum (engine all-reduce)
  to the unsharded result; with dynamic activation scales each rank's per-row activation global
  scale is taken over its own K shard (the FP4 block scales do not change), so TP>1 is within
  NVFP4 rounding of TP=1 rather than bit-identical; with static scales it is exact up to
  float32 summation order.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Sequence

import torch

from foursight.dispatch import PreparedLinear, prepare_linear
from foursight.layer import QuantizedWeight, check_channels
from foursight.nvfp4 import BLOCK_SIZE, NVFP4Error, global_scale_from_amax
from foursight.quant_methods.online import OnlineSettings, weight_based_channels
from foursight.quant_methods.requantize import quantize_fused, quantize_shard
from foursight.quant_methods.sharding import TPContext, concat_shards, localize_channels, shard_index, shard_names
from foursight.schema import (
    BF16_CHANNELS,
    ENV_CHANNELS_FILE,
    INPUT_GLOBAL_SCALE,
    WEIGHT_BF16,
    WEIGHT_GLOBAL_SCALE,
    WEIGHT_PACKED,
    WEIGHT_SCALE,
    CheckpointError,
    FourSightConfig,
    decode_module,
    expected_shapes,
    parse_channel_budget,
)

logger = logging.getLogger("foursight.quant_methods")
#: the weight-based channel fallback warns once per channels file (and once when there is none)
_warned_fallback: set[str] = set()

#: Name of the BF16 weight parameter in online mode (the HF name, so ``load_weights`` finds it).
WEIGHT = "weight"

LoadMode = Literal["checkpoint", "online"]


#: engine weight attributes of the checkpoint tensors with one row per output row (the others are per shard)
_ENGINE_ATTRS: dict[str, dict[str, int]] = {
    WEIGHT_PACKED: {"input_dim": 1, "output_dim": 0, "packed_dim": 1, "packed_factor": 2},
    WEIGHT_SCALE: {"input_dim": 1, "output_dim": 0},
    WEIGHT_BF16: {"output_dim": 0},  # never split along K: kept whole (module docstring, TP)
}
#: the checkpoint's per-tensor [1] scales: one value per shard, a [S] parameter
_PER_TENSOR_SCALARS = (WEIGHT_GLOBAL_SCALE, INPUT_GLOBAL_SCALE)
#: the order the parameters are registered in (and missing tensors named in)
_CHECKPOINT_ORDER = (WEIGHT_PACKED, WEIGHT_SCALE, WEIGHT_BF16, WEIGHT_GLOBAL_SCALE, INPUT_GLOBAL_SCALE, BF16_CHANNELS)


@dataclass
class ParamSpec:
    """One parameter an engine must register in ``create_weights``.

    Attributes:
        name: attribute name on the layer (= checkpoint tensor suffix).
        shape, dtype: allocation.
        attrs: engine weight attributes (``input_dim``, ``output_dim``, ``packed_dim``,
            ``packed_factor``); the engine adds its ``weight_loader``.
        per_shard: True if the parameter holds one row per fused shard and is filled by the
            core's own per-shard loader (the engine loader is not used).
        update_only: True for the empty ``weight`` parameter of a checkpoint-mode layer: it holds
            nothing and is never part of the checkpoint; it exists so that the engine's own
            ``load_weights`` finds a parameter for a BF16 ``<module>.weight`` (an RL weight sync)
            and calls its loader, which quantizes the shard into the checkpoint tensors
            (:meth:`LayerPlan.load_bf16_shard`).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    attrs: dict[str, Any]
    per_shard: bool = False
    update_only: bool = False


@dataclass
class LayerState:
    """Execution state of one layer, rebuilt by :meth:`LayerPlan.process`.

    Attributes:
        qw: the local :class:`QuantizedWeight` (fused shards, local TP part).
        prepared: ``foursight.dispatch.prepare_linear(qw)`` (backend chosen once).
        input_global_scale: float32 [1] static activation scale, or None (dynamic).
        act_quant: W4A4 (True) or W4A16 (False).
        channels: the (global) channel set of the layer, int32 [k].
        generation: how many times the layer has been processed (1 after the first load).
    """

    qw: QuantizedWeight
    prepared: PreparedLinear
    input_global_scale: torch.Tensor | None
    act_quant: bool
    channels: torch.Tensor
    generation: int


@dataclass
class LayerPlan:
    """Everything the core needs to know about one engine linear layer.

    Attributes:
        prefix: engine module name (``model.layers.0.self_attn.qkv_proj``).
        shard_names: checkpoint module names of its shards (``[...q_proj, ...k_proj, ...v_proj]``).
        shard_sizes: local output rows of each shard (this rank).
        input_size: global K.
        input_size_per_partition: local K (== K unless the layer is row-parallel with TP>1).
        tp_rank, tp_size: the layer's TP position (0, 1 for replicated layers).
        mode: ``"checkpoint"`` or ``"online"``.
        k: BF16 channels per shard (checkpoint mode; online mode resolves it at process time).
        act_quant: W4A4 or W4A16.
        static_act_scale: use ``input_global_scale`` (checkpoint) / channels-file amax (online).
        online: online settings (online mode only).
        loaded: ``(tensor suffix, shard index)`` pairs seen by the loaders (for missing-tensor checks).
        generation: number of :meth:`process` calls so far.
        load_events: number of tensors loaded so far (a weight update compares it before/after
            to find the layers it touched).
        stale: True when a tensor was loaded after the last :meth:`process`: the execution state
            no longer matches the parameters (the adapter re-processes before the next forward).
        pending_weight: shard indices that received a BF16 ``weight`` since the last process; when
            it covers every shard the adapter re-processes at once, inside the loader.
        requantized: checkpoint mode: shard indices whose checkpoint tensors were last written by
            :meth:`load_bf16_shard` (our own quantizer, from a finite weight, with the layer's
            validated channels), so :meth:`process` does not check them again as it checks a
            checkpoint's; loading any checkpoint tensor of the shard directly removes it.
    """

    prefix: str
    shard_names: list[str]
    shard_sizes: list[int]
    input_size: int
    input_size_per_partition: int
    tp_rank: int = 0
    tp_size: int = 1
    mode: LoadMode = "checkpoint"
    k: int = 0
    act_quant: bool = True
    static_act_scale: bool = False
    online: OnlineSettings | None = None
    loaded: set[tuple[str, int]] = field(default_factory=set)
    generation: int = 0
    load_events: int = 0
    stale: bool = False
    pending_weight: set[int] = field(default_factory=set)
    requantized: set[int] = field(default_factory=set)

    # ---- construction ---------------------------------------------------------------------

    @classmethod
    def for_layer(
        cls,
        prefix: str,
        output_partition_sizes: Sequence[int],
        input_size: int,
        input_size_per_partition: int,
        config: FourSightConfig,
        packed_modules_mapping: dict[str, list[str]] | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        mode: LoadMode = "checkpoint",
        online: OnlineSettings | None = None,
    ) -> "LayerPlan":
        """Plan for an engine layer. In checkpoint mode, k is read from ``config.channels`` for
        every shard name; shards with different k raise :class:`CheckpointError` naming the layer."""
        names = shard_names(prefix, packed_modules_mapping)
        sizes = list(output_partition_sizes)
        if len(names) != len(sizes):
            if len(sizes) == 1:
                names = [prefix]
            else:
                raise CheckpointError(f"{prefix}: {len(sizes)} output shards but packed_modules_mapping gives {names}")
        if input_size % BLOCK_SIZE or input_size_per_partition % BLOCK_SIZE:
            raise CheckpointError(
                f"{prefix}: input size {input_size} (local {input_size_per_partition}) is not a multiple of {BLOCK_SIZE}; "
                "NVFP4 needs whole 16-blocks per TP shard"
            )
        k = 0
        if mode == "checkpoint":
            ks = {n: config.channels_for(n) for n in names}
            if len(set(ks.values())) > 1:
                raise CheckpointError(f"{prefix}: fused shards have different channel counts in quantization_config.channels: {ks}")
            k = next(iter(ks.values()))
            if k >= input_size:
                raise CheckpointError(f"{prefix}: quantization_config.channels gives k={k} but K={input_size}")
        return cls(
            prefix=prefix,
            shard_names=names,
            shard_sizes=sizes,
            input_size=input_size,
            input_size_per_partition=input_size_per_partition,
            tp_rank=tp_rank,
            tp_size=tp_size,
            mode=mode,
            k=k,
            act_quant=config.activation_dtype == "nvfp4",
            static_act_scale=config.activation_scale == "static",
            online=online,
        )

    @property
    def num_shards(self) -> int:
        return len(self.shard_sizes)

    @property
    def out_local(self) -> int:
        return sum(self.shard_sizes)

    @property
    def k_split(self) -> bool:
        """True if K is split across ranks (row-parallel with TP>1)."""
        return self.input_size_per_partition != self.input_size

    @property
    def k_start(self) -> int:
        return self.tp_rank * self.input_size_per_partition if self.k_split else 0

    def param_specs(self, params_dtype: torch.dtype = torch.bfloat16) -> list[ParamSpec]:
        """Parameters to register (see the module docstring's table)."""
        n, kl, s = self.out_local, self.input_size_per_partition, self.num_shards
        if self.mode == "online":
            return [ParamSpec(WEIGHT, (n, kl), params_dtype, {"input_dim": 1, "output_dim": 0})]
        # the checkpoint format's own table (schema.expected_shapes) for the fused local rows: a tensor
        # with a row per output row is loaded by the engine's loader (the attributes say how it is
        # split); the others ([1] scales, [k] channels) hold one row per fused shard
        shapes = expected_shapes(n, self.input_size, self.k, self.prefix, local_in_features=kl)
        specs = [ParamSpec(WEIGHT, (0,), params_dtype, {}, update_only=True)]
        for name in _CHECKPOINT_ORDER:
            shape, dtype = shapes[name]
            if name in _ENGINE_ATTRS:
                specs.append(ParamSpec(name, shape, dtype, dict(_ENGINE_ATTRS[name])))
            else:
                specs.append(ParamSpec(name, (s,) + (() if name in _PER_TENSOR_SCALARS else shape), dtype, {}, per_shard=True))
        return specs

    def init_value(self, spec: ParamSpec) -> float:
        """Fill value for a fresh parameter (scales 1.0 so an unloaded layer is still finite)."""
        return 1.0 if spec.name in (WEIGHT_GLOBAL_SCALE, INPUT_GLOBAL_SCALE) else 0.0

    def initial_tensor(self, spec: ParamSpec) -> torch.Tensor:
        """A fresh tensor for ``spec`` filled with :meth:`init_value`, for the engine to wrap as a parameter."""
        return torch.full(spec.shape, self.init_value(spec), dtype=torch.float32).to(spec.dtype)

    def tensor_name(self, suffix: str, shard: int | None) -> str:
        """Checkpoint name of a tensor of this layer, e.g. ``model.layers.0.self_attn.k_proj.weight_scale``."""
        if shard is None:
            base = self.shard_names[0] if self.num_shards == 1 else self.prefix
        else:
            base = self.shard_names[shard]
        return f"{base}.{suffix}"

    # ---- loading --------------------------------------------------------------------------

    def make_loader(self, spec: ParamSpec, engine_loader: Callable | None,
                    layer_params: Callable[[], dict[str, torch.Tensor]] | None = None) -> Callable:
        """Weight loader for ``spec``: ``loader(param, loaded_weight, shard_id=None)``.

        Checks the checkpoint dtype (``weight`` accepts any float dtype), records the load, marks
        the layer stale, and delegates: per-shard parameters are copied into their shard row here;
        the checkpoint-mode ``weight`` (``spec.update_only``) quantizes a BF16 shard into the
        layer's checkpoint tensors (:meth:`load_bf16_shard`, which needs ``layer_params``); others
        go to ``engine_loader`` (the engine's column/row/fused loader). Shape errors become
        :class:`CheckpointError` naming the checkpoint tensor.
        """
        plan = self

        def loader(param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Any = None, *args: Any, **kw: Any) -> None:
            idx = shard_index(shard_id, plan.num_shards, plan.prefix)
            name = plan.tensor_name(spec.name, idx if (shard_id is not None or plan.num_shards == 1) else None)
            if spec.name == WEIGHT:
                if not loaded_weight.is_floating_point():
                    raise CheckpointError(f"tensor {name} has dtype {loaded_weight.dtype}, expected a float dtype")
            elif loaded_weight.dtype != spec.dtype:
                raise CheckpointError(f"tensor {name} has dtype {loaded_weight.dtype}, expected {spec.dtype}")
            if spec.update_only:
                if layer_params is None:
                    raise RuntimeError(f"{plan.prefix}: no parameters to quantize {name} into")
                plan.load_bf16_shard(layer_params(), loaded_weight, shard_id)
            elif spec.per_shard:
                plan._load_per_shard(param, loaded_weight, idx, name)
                plan.requantized.discard(idx)
            else:
                if engine_loader is None:
                    raise RuntimeError(f"{plan.prefix}: no engine loader for {spec.name}")
                try:
                    if shard_id is None:
                        engine_loader(param, loaded_weight, *args, **kw)
                    else:
                        engine_loader(param, loaded_weight, shard_id, *args, **kw)
                except (AssertionError, RuntimeError, IndexError) as e:
                    raise CheckpointError(
                        f"tensor {name} has shape {list(loaded_weight.shape)}, which does not fit parameter "
                        f"{plan.prefix}.{spec.name} of local shape {list(param.shape)} (shard {shard_id!r}): {e}"
                    ) from None
                if shard_id is None:
                    plan.requantized.clear()
                else:
                    plan.requantized.discard(idx)
            plan.stale = True
            if spec.name == WEIGHT:
                plan.pending_weight.update(range(plan.num_shards) if shard_id is None else (idx,))
            if spec.update_only:
                return  # the checkpoint tensors' own loaders recorded the load
            plan.load_events += 1
            if shard_id is None and plan.num_shards > 1 and not spec.per_shard:
                plan.loaded.update((spec.name, i) for i in range(plan.num_shards))
            else:
                plan.loaded.add((spec.name, idx))

        return loader

    def load_bf16_shard(self, params: dict[str, torch.Tensor], weight: torch.Tensor, shard_id: Any = None) -> None:
        """Checkpoint mode: quantize one BF16 shard ``<shard>.weight`` (the learner's full, unsharded
        HF tensor, as ``load_weights`` passes it) with the layer's current channel set into the
        checkpoint tensors of that shard, and load those through the layer's own loaders (so TP
        slicing is the engine's, as for a fresh checkpoint load). The static activation scale
        (``input_global_scale``) is calibration, not weight: it is kept. The result equals a fresh
        load of a checkpoint quantized from the same weights with the same channels.

        Raises CheckpointError naming the tensor for a non-2-D or non-finite weight, a wrong K,
        a layer whose channels were never loaded, or a fused tensor given whole (give the shards).
        """
        from foursight.schema import encode_module

        if shard_id is None and self.num_shards > 1:
            raise CheckpointError(f"tensor {self.prefix}.weight: a fused weight given whole; load its shards "
                                  f"({', '.join(n.rpartition('.')[2] for n in self.shard_names)}) by their own names")
        idx = shard_index(shard_id, self.num_shards, self.prefix)
        shard = self.shard_names[idx]
        if weight.dim() != 2 or weight.shape[1] != self.input_size:
            raise CheckpointError(f"tensor {shard}.weight has shape {list(weight.shape)}; layer {self.prefix} expects [rows, {self.input_size}]")
        if (BF16_CHANNELS, idx) not in self.loaded:
            raise CheckpointError(f"tensor {shard}.weight: layer {self.prefix} has no channel set loaded yet (load the checkpoint first)")
        channels = params[BF16_CHANNELS].data[idx].to(weight.device)
        # a fresh load casts a checkpoint's tensors to the engine's dtype before anything else; a float32
        # learner (TRL colocate hands its parameters over as they are) must be rounded the same way
        qw = quantize_shard(weight.to(params[WEIGHT_BF16].dtype), channels, name=shard)
        for key, t in encode_module(shard, qw).items():
            p = params[key.rpartition(".")[2]]
            if shard_id is None:
                p.weight_loader(p, t)
            else:
                p.weight_loader(p, t, shard_id)
        self.requantized.add(idx)

    def weight_complete(self) -> bool:
        """True when every shard received a BF16 ``weight`` since the last :meth:`process`."""
        return len(self.pending_weight) == self.num_shards

    def _load_per_shard(self, param: torch.Tensor, loaded: torch.Tensor, idx: int, name: str) -> None:
        row = param.data[idx]
        if row.dim() == 0:  # per-shard scalar: the checkpoint holds [1] (or a bare scalar)
            if tuple(loaded.shape) not in ((), (1,)):
                raise CheckpointError(f"tensor {name} has shape {list(loaded.shape)}, expected [1]")
            row.copy_(loaded.reshape(()))
            return
        if tuple(loaded.shape) != tuple(row.shape):
            raise CheckpointError(f"tensor {name} has shape {list(loaded.shape)}, expected {list(row.shape)}")
        row.copy_(loaded)

    def missing(self, specs: Sequence[ParamSpec]) -> list[str]:
        """Checkpoint names of tensors no loader has seen (empty when complete).

        ``input_global_scale`` is only required when static activation scales are used.
        """
        out = []
        for spec in specs:
            if spec.update_only or (spec.name == INPUT_GLOBAL_SCALE and not self.static_act_scale):
                continue
            for i in range(self.num_shards):
                if (spec.name, i) not in self.loaded:
                    out.append(self.tensor_name(spec.name, i))
        return out

    # ---- post-load processing --------------------------------------------------------------

    def process(self, params: dict[str, torch.Tensor], tp: TPContext | None = None, check_complete: bool = True) -> LayerState:
        """Build the execution state from the loaded parameters (idempotent, pure).

        Args:
            params: spec name -> the layer's parameter tensor (never modified here).
            tp: the engine's TP collectives (needed for online quantization with TP>1).
            check_complete: raise :class:`CheckpointError` naming the first missing tensor.
        Returns:
            A fresh :class:`LayerState`; calling twice on the same parameters gives equal states.
        """
        tp = tp or TPContext(self.tp_rank, self.tp_size)
        self.generation += 1
        if self.mode == "online":
            qw, igs, channels = self._quantize_online(params[WEIGHT], tp)
        else:
            if check_complete:
                miss = self.missing(self.param_specs())
                if miss:
                    raise CheckpointError(f"missing tensor {miss[0]}" + (f" (and {len(miss) - 1} more)" if len(miss) > 1 else ""))
            qw, igs, channels = self._from_checkpoint(params)
        return LayerState(qw, prepare_linear(qw, self.prefix), igs, self.act_quant, channels, self.generation)

    def _from_checkpoint(self, params: dict[str, torch.Tensor]) -> tuple[QuantizedWeight, torch.Tensor | None, torch.Tensor]:
        packed, scale, wbf = params[WEIGHT_PACKED].data, params[WEIGHT_SCALE].data, params[WEIGHT_BF16].data
        gs_all, igs_all, ch_all = params[WEIGHT_GLOBAL_SCALE].data, params[INPUT_GLOBAL_SCALE].data, params[BF16_CHANNELS].data
        parts: list[QuantizedWeight] = []
        off = 0
        kl = self.input_size_per_partition
        for i, (name, rows) in enumerate(zip(self.shard_names, self.shard_sizes)):
            t = {
                WEIGHT_PACKED: packed[off : off + rows],
                WEIGHT_SCALE: scale[off : off + rows],
                WEIGHT_GLOBAL_SCALE: gs_all[i : i + 1],
                INPUT_GLOBAL_SCALE: igs_all[i : i + 1],
                BF16_CHANNELS: ch_all[i],
                WEIGHT_BF16: wbf[off : off + rows],
            }
            if i in self.requantized:  # written by our quantizer, not read from a file: nothing to check again
                parts.append(QuantizedWeight(t[WEIGHT_PACKED], t[WEIGHT_SCALE], t[WEIGHT_GLOBAL_SCALE].float(), t[BF16_CHANNELS], t[WEIGHT_BF16]))
            else:  # channel values are global indices: validated against the global K
                parts.append(decode_module(name, t, rows, self.input_size, self.k, local_in_features=kl))
            off += rows
        qw = concat_shards(parts, self.prefix)
        if len(parts) > 1:
            # the shards are consecutive row ranges of the layer's parameters: the execution state
            # reads the parameters themselves rather than a concatenated copy of them (one copy of
            # the checkpoint tensors in the engine, issue 36 item 6)
            qw = QuantizedWeight(packed, scale, qw.weight_global_scale, qw.bf16_channels, wbf)
        channels = qw.bf16_channels.clone()
        if self.k_split:
            local, keep = localize_channels(qw.bf16_channels, self.k_start, kl)
            qw = QuantizedWeight(qw.weight_packed, qw.weight_scale, qw.weight_global_scale, local.to(packed.device), qw.weight_bf16[:, keep.to(wbf.device)].contiguous())
        igs = None
        if self.static_act_scale:
            igs = _shared_input_scale(igs_all, self.prefix)
        return qw, igs, channels

    def resolve_online_channels(self, weight: torch.Tensor, tp: TPContext) -> torch.Tensor:
        """Global channel set (int32 [k], sorted) for online quantization of this layer.

        From the channels file when it lists the layer's shards (they must agree), else the
        weight-based fallback with the budget, with a warning logged once per process.
        """
        st = self.online or OnlineSettings()
        cf = st.channels_file
        if cf is not None:
            sets = [cf.channels.get(n) for n in self.shard_names]
            if all(s is not None for s in sets):
                if any(s != sets[0] for s in sets[1:]):
                    raise CheckpointError(f"{self.prefix}: channels file {cf.path} lists different channels for the fused shards {self.shard_names}")
                return check_channels(cf.channel_tensor(self.shard_names[0]), self.input_size, self.prefix)
            missing = [n for n, s in zip(self.shard_names, sets) if s is None]
            key = f"missing:{cf.path}"
            if key not in _warned_fallback:
                _warned_fallback.add(key)
                logger.warning("FourSight: channels file %s has no entry for %s (and maybe others); using weight-based channel selection for those layers", cf.path, missing[0])
        else:
            if "nofile" not in _warned_fallback:
                _warned_fallback.add("nofile")
                logger.warning(
                    "FourSight: no channels file (set %s or pass one to the quantization config); selecting BF16 channels from the weights "
                    "(largest column amax, budget %s). Calibrated channels from `foursight calibrate` are better.",
                    ENV_CHANNELS_FILE,
                    st.budget,
                )
        k = parse_channel_budget(st.budget, self.input_size, self.prefix)
        return weight_based_channels(weight, k, tp, self.k_split)

    def _quantize_online(self, weight: torch.Tensor, tp: TPContext) -> tuple[QuantizedWeight, torch.Tensor | None, torch.Tensor]:
        w = weight.data
        channels = self.resolve_online_channels(w, tp).to(w.device)
        kl = self.input_size_per_partition
        if self.k_split:
            local, keep = localize_channels(channels, self.k_start, kl)
        else:
            local = channels
        names = [f"{n}.weight" for n in self.shard_names]
        if tp.size == 1:  # each shard's per-tensor scale is its own amax: one quantizer call for the fused layer
            try:
                qw = quantize_fused(w, local, self.shard_sizes, names)
            except NVFP4Error as e:
                raise CheckpointError(f"tensor {e}") from None
        else:
            parts: list[QuantizedWeight] = []
            off = 0
            for name, rows in zip(names, self.shard_sizes):
                ws = w[off : off + rows]
                a = ws.abs()  # in the weight's dtype (exact), S columns zeroed in place
                if local.numel():
                    a.index_fill_(1, local.long(), 0)
                amax = tp.reduce_max(a.amax().float().reshape(1).contiguous())  # shared per-tensor scale across ranks
                gs = global_scale_from_amax(amax).reshape(1)
                try:  # on the CPU the quantizer checks every value finite (no separate pass here)
                    parts.append(quantize_shard(ws, local, global_scale=gs, name=name))
                except NVFP4Error as e:
                    raise CheckpointError(f"tensor {e}") from None
                off += rows
            qw = concat_shards(parts, self.prefix)
        igs = None
        if self.static_act_scale:
            cf = self.online.channels_file if self.online else None
            if cf is None:
                raise CheckpointError(f"{self.prefix}: static activation scale requested but no channels file was given")
            igs = cf.input_scale(self.shard_names, self.prefix)
        return qw, igs, channels.to(torch.int32)


def _shared_input_scale(igs: torch.Tensor, layer: str) -> torch.Tensor:
    """One static activation scale for a fused layer: the smallest per-shard scale (the
    largest calibrated amax, so no shard's input clips); warns if the shards disagree."""
    v = igs.float().reshape(-1)
    if v.numel() > 1 and not bool((v == v[0]).all()):
        logger.warning("FourSight: %s: shards have different input_global_scale %s; using the smallest", layer, v.tolist())
    return v.min().reshape(1)


def apply_linear(state: LayerState, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Forward of a processed layer: x [..., K_loc] → [..., N_loc] in x's dtype.

    Raises RuntimeError if the layer was never processed (``process`` not called).
    """
    if state is None:
        raise RuntimeError("FourSight layer used before process_weights_after_loading")
    return state.prepared(x, bias, state.input_global_scale, state.act_quant)


def layer_params(layer: Any, plan: LayerPlan) -> dict[str, torch.Tensor]:
    """``{spec name: getattr(layer, spec name)}`` for a plan's parameters."""
    return {s.name: getattr(layer, s.name) for s in plan.param_specs()}


def _state_tensors(obj: Any, out: list[torch.Tensor], seen: set[int]) -> None:
    """Every tensor reachable from an execution state (dataclass fields, tuples, lists, dicts), in
    a fixed order; an object met twice (the same QuantizedWeight held by the state and by its
    prepared form) is walked once."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
        return
    if id(obj) in seen or obj is None or isinstance(obj, (bool, int, float, str)):
        return
    seen.add(id(obj))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _state_tensors(getattr(obj, f.name), out, seen)
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            _state_tensors(x, out, seen)
    elif isinstance(obj, dict):
        for x in obj.values():
            _state_tensors(x, out, seen)


def install_state(layer: Any, new: LayerState) -> bool:
    """Make ``new`` the layer's execution state, in place when possible.

    When the layer already has a state whose tensors match ``new``'s one for one (shape, dtype,
    device: always so for a weight update with a fixed channel set), the new values are copied
    into the old tensors, so the storage a captured CUDA graph points at stays valid; the
    state object is kept. Otherwise (first load, or a re-selected channel set whose count
    changed) the state is replaced. Returns True when it was updated in place.
    """
    old = getattr(layer, "foursight_state", None)
    if old is not None and type(old.prepared.backend) is type(new.prepared.backend):
        a: list[torch.Tensor] = []
        b: list[torch.Tensor] = []
        _state_tensors(old, a, set())
        _state_tensors(new, b, set())
        if len(a) == len(b) and all(x.shape == y.shape and x.dtype == y.dtype and x.device == y.device for x, y in zip(a, b)):
            with torch.no_grad():
                for x, y in zip(a, b):
                    if x.data_ptr() != y.data_ptr():
                        x.copy_(y)
            old.generation = new.generation
            return True
    layer.foursight_state = new
    return False


def refresh_layer(layer: Any, tp: TPContext | None = None) -> LayerState:
    """Re-process a layer from its parameters (:meth:`LayerPlan.process`), install the state in
    place (:func:`install_state`) and clear its stale marks; the one re-quantization step of every
    route (the engines' post-load hook, a stale layer's next forward, a completed BF16 sync)."""
    plan: LayerPlan = layer.foursight_plan
    install_state(layer, plan.process(layer_params(layer, plan), tp))
    plan.stale = False
    plan.pending_weight.clear()
    return layer.foursight_state
