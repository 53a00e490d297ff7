"""The per-layer plan shared by the vLLM and SGLang adapters: a :class:`LayerPlan` per engine linear
layer, made by composition of

* a :class:`~foursight.quant_methods.layer_layout.LayerLayout`: the layer's shards, sizes, TP position
  and precision;
* a :class:`~foursight.quant_methods.layer_loading.LayerLoader`: the weight loaders the engine calls
  and their bookkeeping, with the parameters' kinds
  (:mod:`~foursight.quant_methods.param_kinds`) carrying each one's loading rule;

and one of two small plans, by what the engine loads: :class:`CheckpointPlan` (a FourSight checkpoint:
the checkpoint tensors, and a BF16 ``weight`` that a weight update quantizes into them) or
:class:`OnlinePlan` (a BF16 checkpoint quantized at load). Each says which parameters it registers
(``param_specs``), how it builds the execution state from them (``build``: decode, or quantize) and what
it frees after (``release``). The execution state, its forward and its installation in place are
:mod:`~foursight.quant_methods.layer_state`'s; :func:`refresh_layer` is the one re-quantization step of
every route.

**One weight copy inside the engine** (issue 36 item 6): where the execution form gives back the
checkpoint's FP4 codes and block scales exactly, :meth:`CheckpointPlan.release` frees the storage of the
``weight_packed`` / ``weight_scale`` parameters after processing (shapes, parameter objects and loaders
stay); the first write into the layer and :meth:`LayerPlan.process` rebuild them from that form first
(:meth:`~foursight.quant_methods.layer_loading.LayerLoader.restore_released`), so the shards an update does
not write keep their values. On the CPU the reference's float32 weight cannot rebuild the codes: they stay.

Nothing here imports an engine. :class:`FourSightLinearMethodBase`, at the end, is the linear method
both engine adapters mix into theirs (``vllm_method.py``, ``sglang_method.py``, with
:class:`foursight.quant_methods.config.FourSightMethodConfig` for the config): its hooks do four thin
things and call the plan for everything else:

1. **create_weights**: build the plan (:func:`plan_for_layer`), then for each parameter kind of
   ``plan.param_specs(params_dtype)`` register a parameter of that shape / dtype with the spec's
   ``attrs`` and the loader ``plan.loader.make_loader(spec, engine_loader)`` (``engine_loader`` is the
   layer's own column/row/QKV/merged loader; the plan wraps it with dtype checks, error messages
   that name the checkpoint tensor, and bookkeeping of what was loaded).
2. **process_weights_after_loading**: :func:`refresh_layer`: ``plan.process(params, tp)``. It is
   *idempotent*: it never changes the loaded parameters' values, it rebuilds the execution state from
   them every time (so a second call, or a call after a weight reload, cannot double-apply a transform --
   the class of bug of sglang#30761 / verl#7519); then the checkpoint codes are released where the
   execution form can rebuild them (above).
3. **apply**: ``apply_linear(layer.foursight_state, x, bias)`` → the layer's
   :class:`foursight.dispatch.PreparedLinear` (SpliceGEMM on CUDA, the PyTorch reference on
   CPU; the backend is chosen once, in ``process``).
4. **TP**: pass a :class:`TPContext` whose collectives are the engine's (identity at TP=1).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Self, Sequence

import torch

from foursight.dispatch import prepare_linear
from foursight.layer import QuantizedWeight
from foursight.nvfp4 import NVFP4Error, global_scale_from_amax
from foursight.quant_methods.config import FourSightMethodConfig
from foursight.quant_methods.layer_layout import WEIGHT, LayerLayout
from foursight.quant_methods.layer_loading import LayerLoader
from foursight.quant_methods.layer_state import LayerState, apply_linear, install_state, shares_storage
from foursight.quant_methods.online import OnlineSettings, resolve_channels
from foursight.quant_methods.param_kinds import BF16UpdateParam, BF16WeightParam, ParamSpec, PerShardParam, RowsParam
from foursight.quant_methods.requantize import quantize_fused, quantize_shard
from foursight.quant_methods.sharding import TPContext, concat_shards, localize_channels
from foursight.schema import (
    BF16_CHANNELS,
    ENV_ONLINE_KEEP_BF16,
    INPUT_GLOBAL_SCALE,
    WEIGHT_BF16,
    WEIGHT_GLOBAL_SCALE,
    WEIGHT_PACKED,
    WEIGHT_SCALE,
    CheckpointError,
    FourSightConfig,
    decode_module,
    expected_shapes,
)

logger = logging.getLogger("foursight.quant_methods")

#: what a plan builds from its parameters: the local weight, the static activation scale (or None), the global channels
Built = tuple[QuantizedWeight, torch.Tensor | None, torch.Tensor]


@dataclass
class LayerPlan:
    """Everything the core needs to know about one engine linear layer: its :attr:`layout`, its
    :attr:`loader` (the loaders and their bookkeeping) and its post-load processing. A subclass says
    what the engine loads: :class:`CheckpointPlan` or :class:`OnlinePlan`; build one with
    :func:`plan_for_layer` or the subclass's ``for_layer``.

    Attributes:
        layout: the layer's shards, sizes, TP position and precision.
        loader: its loaders and what they loaded (``loader.layout`` is :attr:`layout`).
        backend: the backend that prepares and runs this layer (``foursight.dispatch.LinearBackend``); None:
            chosen by ``foursight.dispatch.select_backend`` (the reference on CPU tensors, Triton on CUDA).
            The tests set the Triton backend to run the fragment form on the CPU under the Triton interpreter.
        keep_checkpoint: True where the engine offloads weights to the CPU (vLLM's ``cpu_offload_gb`` /
            prefetch offloaders): there the parameters are the weights the offloader copies back after
            processing and streams every forward, so :meth:`release` leaves them (and they take no GPU
            memory to begin with).
        generation: number of :meth:`process` calls so far.
    """

    layout: LayerLayout
    loader: LayerLoader
    backend: Any = None
    keep_checkpoint: bool = False
    generation: int = 0

    #: the layer quantizes a BF16 weight when it is processed (it takes no checkpoint tensors)
    quantizes_at_load: ClassVar[bool] = False

    @classmethod
    def from_layout(cls, layout: LayerLayout, **kw: Any) -> Self:
        return cls(layout, LayerLoader(layout), **kw)

    def param_specs(self, params_dtype: torch.dtype = torch.bfloat16) -> list[ParamSpec]:
        """The parameters to register, each of its kind (:mod:`~foursight.quant_methods.param_kinds`)."""
        raise NotImplementedError

    def build(self, params: dict[str, torch.Tensor], tp: TPContext, check_complete: bool) -> Built:
        """The local weight, static activation scale and global channels from the loaded parameters."""
        raise NotImplementedError

    def release(self, params: dict[str, torch.Tensor], state: LayerState) -> int:
        """Free what the processed layer no longer needs; returns the bytes freed."""
        raise NotImplementedError

    def process(self, params: dict[str, torch.Tensor], tp: TPContext | None = None, check_complete: bool = True) -> LayerState:
        """Build the execution state from the loaded parameters (idempotent, pure).

        Args:
            params: spec name -> the layer's parameter tensor (never modified here).
            tp: the engine's TP collectives (needed for online quantization with TP>1).
            check_complete: raise :class:`CheckpointError` naming the first missing tensor.
        Returns:
            A fresh :class:`LayerState`; calling twice on the same parameters gives equal states.
        """
        lay = self.layout
        tp = tp or TPContext(lay.tp_rank, lay.tp_size)
        self.loader.restore_released(params)  # nothing reads a freed parameter
        if self.loader.bf16_released:
            raise CheckpointError(f"{lay.prefix}: its BF16 weights were freed after quantization ({ENV_ONLINE_KEEP_BF16}=0), so it cannot be "
                                  "quantized again; start the engine without that setting to load or update weights")
        self.generation += 1
        qw, igs, channels = self.build(params, tp, check_complete)
        return LayerState(qw, prepare_linear(qw, lay.prefix, backend=self.backend), igs, lay.act_quant, channels, self.generation)


#: engine weight attributes of the checkpoint tensors with one row per output row
_ROWS_ATTRS: dict[str, dict[str, int]] = {
    WEIGHT_PACKED: {"input_dim": 1, "output_dim": 0, "packed_dim": 1, "packed_factor": 2},
    WEIGHT_SCALE: {"input_dim": 1, "output_dim": 0},
    WEIGHT_BF16: {"output_dim": 0},  # never split along K: kept whole (layer_layout's docstring, TP)
}


@dataclass
class CheckpointPlan(LayerPlan):
    """A layer loaded from a FourSight checkpoint (the tensors of :mod:`~foursight.quant_methods.param_kinds`'
    table), which takes a BF16 weight update by quantizing it into them."""

    @classmethod
    def for_layer(cls, prefix: str, output_partition_sizes: Sequence[int], input_size: int, input_size_per_partition: int,
                  config: FourSightConfig, packed_modules_mapping: dict[str, list[str]] | None = None,
                  tp_rank: int = 0, tp_size: int = 1) -> Self:
        """The plan of an engine layer; k is read from ``config.channels`` for every shard name (shards with
        different k raise :class:`CheckpointError` naming the layer)."""
        return cls.from_layout(LayerLayout.for_layer(prefix, output_partition_sizes, input_size, input_size_per_partition, config,
                                                     packed_modules_mapping, tp_rank, tp_size, channels_from_config=True))

    def param_specs(self, params_dtype: torch.dtype = torch.bfloat16) -> list[ParamSpec]:
        lay = self.layout
        # the checkpoint format's own table (schema.expected_shapes) for the fused local rows: a tensor with a row
        # per output row is loaded by the engine's loader; the others ([1] scales, [k] channels) hold one row per shard
        shapes = expected_shapes(lay.out_local, lay.input_size, lay.k, lay.prefix, local_in_features=lay.input_size_per_partition)
        s = lay.num_shards

        def rows(name: str) -> RowsParam:
            return RowsParam(name, *shapes[name], dict(_ROWS_ATTRS[name]))

        def per_shard(name: str, **kw: Any) -> PerShardParam:
            return PerShardParam(name, (s,) + (() if name != BF16_CHANNELS else shapes[name][0]), shapes[name][1], **kw)

        return [
            BF16UpdateParam(WEIGHT, (0,), params_dtype, quantize=quantize_shard),
            rows(WEIGHT_PACKED),
            rows(WEIGHT_SCALE),
            rows(WEIGHT_BF16),
            per_shard(WEIGHT_GLOBAL_SCALE, fill=1.0),
            per_shard(INPUT_GLOBAL_SCALE, fill=1.0, static_only=True),
            per_shard(BF16_CHANNELS),
        ]

    def build(self, params: dict[str, torch.Tensor], tp: TPContext, check_complete: bool) -> Built:
        lay = self.layout
        if check_complete:
            miss = self.loader.missing(self.param_specs())
            if miss:
                raise CheckpointError(f"missing tensor {miss[0]}" + (f" (and {len(miss) - 1} more)" if len(miss) > 1 else ""))
        packed, scale, wbf = params[WEIGHT_PACKED].data, params[WEIGHT_SCALE].data, params[WEIGHT_BF16].data
        gs_all, igs_all, ch_all = params[WEIGHT_GLOBAL_SCALE].data, params[INPUT_GLOBAL_SCALE].data, params[BF16_CHANNELS].data
        parts: list[QuantizedWeight] = []
        off = 0
        kl = lay.input_size_per_partition
        for i, (name, rows) in enumerate(zip(lay.shard_names, lay.shard_sizes)):
            t = {
                WEIGHT_PACKED: packed[off : off + rows],
                WEIGHT_SCALE: scale[off : off + rows],
                WEIGHT_GLOBAL_SCALE: gs_all[i : i + 1],
                INPUT_GLOBAL_SCALE: igs_all[i : i + 1],
                BF16_CHANNELS: ch_all[i],
                WEIGHT_BF16: wbf[off : off + rows],
            }
            if i in self.loader.requantized:  # written by our quantizer, not read from a file: nothing to check again
                parts.append(QuantizedWeight(t[WEIGHT_PACKED], t[WEIGHT_SCALE], t[WEIGHT_GLOBAL_SCALE].float(), t[BF16_CHANNELS], t[WEIGHT_BF16]))
            else:  # channel values are global indices: validated against the global K
                parts.append(decode_module(name, t, rows, lay.input_size, lay.k, local_in_features=kl))
            off += rows
        qw = concat_shards(parts, lay.prefix)
        if len(parts) > 1:
            # the shards are consecutive row ranges of the layer's parameters: the execution state
            # reads the parameters themselves rather than a concatenated copy of them (one copy of
            # the checkpoint tensors in the engine, issue 36 item 6)
            qw = QuantizedWeight(packed, scale, qw.weight_global_scale, qw.bf16_channels, wbf)
        channels = qw.bf16_channels.clone()
        if lay.k_split:
            local, keep = localize_channels(qw.bf16_channels, lay.k_start, kl)
            qw = QuantizedWeight(qw.weight_packed, qw.weight_scale, qw.weight_global_scale, local.to(packed.device), qw.weight_bf16[:, keep.to(wbf.device)].contiguous())
        igs = _shared_input_scale(igs_all, lay.prefix) if lay.static_act_scale else None
        return qw, igs, channels

    def release(self, params: dict[str, torch.Tensor], state: LayerState) -> int:
        """Free the storage of the ``weight_packed`` / ``weight_scale`` parameters when ``state``'s
        execution form rebuilds them exactly (``foursight.kernels.backends.rebuilds_checkpoint``) and holds
        none of their storage; their shapes, the parameter objects and their loaders stay, so the engine
        still sees them. Returns the bytes freed (0 when they stay: the CPU reference, an experimental
        backend, an engine that keeps the checkpoint, or already released)."""
        from foursight.kernels.backends import rebuilds_checkpoint  # plain Python: no Triton import

        form, loader = state.prepared.state, self.loader
        if self.keep_checkpoint or loader.released is not None or not rebuilds_checkpoint(form):
            return 0
        storages = {name: params[name].untyped_storage() for name in (WEIGHT_PACKED, WEIGHT_SCALE)}
        if shares_storage(form, list(storages.values())):
            return 0  # the execution form reads them: they are its copy, not a second one
        if not all(st.resizable() for st in storages.values()):
            return 0  # memory the engine mapped itself (vLLM's UVA weight offloading): left as it is
        loader.released_bytes = {name: st.nbytes() for name, st in storages.items()}
        for st in storages.values():
            st.resize_(0)
        loader.released = form
        return sum(loader.released_bytes.values())


def _shared_input_scale(igs: torch.Tensor, layer: str) -> torch.Tensor:
    """One static activation scale for a fused layer: the smallest per-shard scale (the
    largest calibrated amax, so no shard's input clips); warns if the shards disagree."""
    v = igs.float().reshape(-1)
    if v.numel() > 1 and not bool((v == v[0]).all()):
        logger.warning("FourSight: %s: shards have different input_global_scale %s; using the smallest", layer, v.tolist())
    return v.min().reshape(1)


@dataclass
class OnlinePlan(LayerPlan):
    """A layer of a BF16 checkpoint quantized at load (``--quantization foursight`` on a plain HF model, and
    the RL weight-update path): one BF16 ``weight`` parameter, which :meth:`build` quantizes, each shard with
    its own global scale and the shared channel set of a channels file or, failing that, of the weight."""

    settings: OnlineSettings | None = None

    quantizes_at_load: ClassVar[bool] = True

    @classmethod
    def for_layer(cls, prefix: str, output_partition_sizes: Sequence[int], input_size: int, input_size_per_partition: int,
                  config: FourSightConfig, packed_modules_mapping: dict[str, list[str]] | None = None,
                  tp_rank: int = 0, tp_size: int = 1, settings: OnlineSettings | None = None) -> Self:
        return cls.from_layout(LayerLayout.for_layer(prefix, output_partition_sizes, input_size, input_size_per_partition, config,
                                                     packed_modules_mapping, tp_rank, tp_size), settings=settings)

    def param_specs(self, params_dtype: torch.dtype = torch.bfloat16) -> list[ParamSpec]:
        lay = self.layout
        return [BF16WeightParam(WEIGHT, (lay.out_local, lay.input_size_per_partition), params_dtype, {"input_dim": 1, "output_dim": 0})]

    def build(self, params: dict[str, torch.Tensor], tp: TPContext, check_complete: bool) -> Built:
        lay = self.layout
        w = params[WEIGHT].data
        channels = resolve_channels(self.settings, lay, w, tp).to(w.device)
        local = localize_channels(channels, lay.k_start, lay.input_size_per_partition)[0] if lay.k_split else channels
        names = [f"{n}.weight" for n in lay.shard_names]
        if tp.size == 1:  # each shard's per-tensor scale is its own amax: one quantizer call for the fused layer
            try:
                qw = quantize_fused(w, local, lay.shard_sizes, names)
            except NVFP4Error as e:
                raise CheckpointError(f"tensor {e}") from None
        else:
            parts: list[QuantizedWeight] = []
            off = 0
            for name, rows in zip(names, lay.shard_sizes):
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
            qw = concat_shards(parts, lay.prefix)
        igs = None
        if lay.static_act_scale:
            cf = self.settings.channels_file if self.settings else None
            if cf is None:
                raise CheckpointError(f"{lay.prefix}: static activation scale requested but no channels file was given")
            igs = cf.input_scale(lay.shard_names, lay.prefix)
        return qw, igs, channels.to(torch.int32)

    def release(self, params: dict[str, torch.Tensor], state: LayerState) -> int:
        """With ``keep_bf16`` off (``FOURSIGHT_ONLINE_KEEP_BF16=0``): free the BF16 ``weight`` once the execution form
        holds the layer (it keeps its own ``W[:, S]``), and the quantizer's codes and scales where the form rebuilds
        them (as :meth:`CheckpointPlan.release`); the parameter and its shape stay, its loader refuses writes."""
        if self.settings is None or self.settings.keep_bf16 or self.keep_checkpoint or self.loader.bf16_released:
            return 0
        from foursight.kernels.backends import rebuilds_checkpoint  # plain Python: no Triton import

        form = state.prepared.state
        st = params[WEIGHT].untyped_storage()
        if shares_storage(form, [st]) or not st.resizable():
            return 0  # the execution form reads it, or the engine mapped it itself
        freed = [st]
        # the quantizer's codes and scales: a second copy where the form rebuilds them (engine-h100-2026-12-07b)
        codes = [state.qw.weight_packed.untyped_storage(), state.qw.weight_scale.untyped_storage()]
        if rebuilds_checkpoint(form) and not shares_storage(form, codes) and all(c.resizable() for c in codes):
            freed += codes
        n = sum(c.nbytes() for c in freed)
        for c in freed:
            c.resize_(0)
        self.loader.bf16_released = True
        return n


def plan_for_layer(prefix: str, output_partition_sizes: Sequence[int], input_size: int, input_size_per_partition: int,
                   config: FourSightConfig, packed_modules_mapping: dict[str, list[str]] | None = None, tp_rank: int = 0,
                   tp_size: int = 1, online: OnlineSettings | None = None) -> LayerPlan:
    """The plan of an engine layer: an :class:`OnlinePlan` with ``online`` settings (a BF16 checkpoint), else a
    :class:`CheckpointPlan`."""
    args = (prefix, output_partition_sizes, input_size, input_size_per_partition, config, packed_modules_mapping, tp_rank, tp_size)
    return OnlinePlan.for_layer(*args, settings=online) if online is not None else CheckpointPlan.for_layer(*args)


def layer_params(layer: Any, plan: LayerPlan) -> dict[str, torch.Tensor]:
    """``{spec name: getattr(layer, spec name)}`` for a plan's parameters."""
    return {s.name: getattr(layer, s.name) for s in plan.param_specs()}


def restore_layer(layer: Any) -> None:
    """Give a layer its released checkpoint parameters back (:meth:`CheckpointPlan.release`), for an engine
    route that writes them without their loaders (SGLang's ``load_format="direct"``); a no-op otherwise."""
    plan = layer.foursight_plan
    plan.loader.restore_released(layer_params(layer, plan))


def refresh_layer(layer: Any, tp: TPContext | None = None) -> LayerState:
    """Re-process a layer from its parameters (:meth:`LayerPlan.process`), install the state in
    place (:func:`~foursight.quant_methods.layer_state.install_state`) and clear its stale marks; the one
    re-quantization step of every route (the engines' post-load hook, a stale layer's next forward, a
    completed BF16 sync)."""
    plan = layer.foursight_plan
    params = layer_params(layer, plan)
    install_state(layer, plan.process(params, tp))
    plan.loader.mark_processed()
    plan.release(params, layer.foursight_state)  # one weight copy: the execution form's, where it rebuilds the codes
    return layer.foursight_state


class FourSightLinearMethodBase:
    """The engine-neutral linear method, mixed into each engine's ``LinearMethodBase`` subclass.

    The engine subclass provides :meth:`tp_context` (its TP group as a
    :class:`~foursight.quant_methods.sharding.TPContext`) and :meth:`set_attrs` (its
    ``set_weight_attrs``); it may wrap the loaders (:meth:`wrap_loader`).
    """

    def __init__(self, quant_config: FourSightMethodConfig, prefix: str):
        self.quant_config = quant_config
        self.prefix = prefix

    def tp_context(self, layer: torch.nn.Module) -> TPContext:
        raise NotImplementedError

    def set_attrs(self, param: torch.nn.Parameter, attrs: dict[str, Any]) -> None:
        raise NotImplementedError

    def wrap_loader(self, layer: torch.nn.Module, loader: Callable) -> Callable:
        return loader

    def keeps_checkpoint(self) -> bool:
        """Whether the engine needs the checkpoint parameters after processing (it offloads weights to
        the CPU): then :meth:`LayerPlan.release` leaves them."""
        return False

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
        """Register the plan's parameters with the plan's loaders around the engine's own."""
        tp = self.tp_context(layer)
        qc = self.quant_config
        plan = plan_for_layer(self.prefix, output_partition_sizes, input_size, input_size_per_partition, qc.fs_config,
                              qc.packed_mapping(), tp_rank=tp.rank, tp_size=tp.size, online=qc.online)
        engine_loader = extra_weight_attrs.pop("weight_loader", None)
        for spec in plan.param_specs(params_dtype):
            p = torch.nn.Parameter(spec.initial_tensor(), requires_grad=False)
            core = plan.loader.make_loader(spec, engine_loader, lambda: layer_params(layer, plan))
            self.set_attrs(p, {**spec.attrs, **extra_weight_attrs, "weight_loader": self.wrap_loader(layer, self._syncing_loader(layer, spec.name, core))})
            layer.register_parameter(spec.name, p)
        layer.foursight_plan = plan
        layer.foursight_state = None

    def _syncing_loader(self, layer: torch.nn.Module, name: str, loader: Callable) -> Callable:
        """A BF16 ``weight`` load that completes every shard of an already-served layer re-quantizes
        it at once, in place (:func:`refresh_layer`): TRL's
        one-tensor-at-a-time ``load_weights`` sync has no post-load step (docs/weight-sync.md)."""
        if name != WEIGHT:
            return loader

        def weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor, *args: Any, **kw: Any) -> None:
            loader(param, loaded_weight, *args, **kw)
            plan: LayerPlan = layer.foursight_plan
            if layer.foursight_state is not None and plan.loader.weight_complete():
                refresh_layer(layer, self.tp_context(layer))

        return weight_loader

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Validate and build the execution state from the loaded parameters, when the layer has
        none yet or a tensor was loaded since the last build (idempotent; the parameters' values never
        change, so a second call or a call after a weight reload is safe; their codes may then be
        released, :meth:`LayerPlan.release`)."""
        plan: LayerPlan = layer.foursight_plan
        plan.keep_checkpoint = self.keeps_checkpoint()
        if layer.foursight_state is None or plan.loader.stale:
            refresh_layer(layer, self.tp_context(layer))

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if layer.foursight_plan.loader.stale:  # part of a fused layer was synced and no post-load step ran
            refresh_layer(layer, self.tp_context(layer))
        return apply_linear(layer.foursight_state, x, bias)
