"""The per-layer plan shared by the vLLM and SGLang adapters: :class:`LayerPlan`, one per engine
linear layer, made of three subjects:

* :mod:`~foursight.quant_methods.layer_layout`: the parameters a layer registers (shapes from the
  checkpoint format's table, ``schema.expected_shapes``), the load modes and tensor parallelism;
* :mod:`~foursight.quant_methods.layer_loading`: the loaders, their bookkeeping and the RL weight
  update of a checkpoint-mode layer;
* this module: the post-load processing (the execution state built from the loaded parameters,
  installed in place) and the forward, and :class:`LayerPlan`, which joins the three.

The new state is copied into the old one's tensors when they match (:func:`install_state`), so
storage a captured CUDA graph reads stays valid; :func:`refresh_layer` is the one re-quantization
step of every route.

**One weight copy inside the engine** (issue 36 item 6): where the backend's execution form gives
back the checkpoint's FP4 codes and block scales exactly (``foursight.kernels.backends.rebuilds_checkpoint``:
the GPU's fragment form), :meth:`LayerPlan.release` frees the storage of the ``weight_packed`` /
``weight_scale`` parameters after processing (shapes, parameter objects and loaders stay); the first
write into the layer (any of its loaders: a checkpoint reload, a BF16 or packed weight update, one
shard of a fused layer) and :meth:`LayerPlan.process` rebuild them from that form first
(:meth:`~foursight.quant_methods.layer_loading.LayerLoading.restore_released`), so the shards an update
does not write keep their values. The small tensors stay (``W[:, S]`` is shared with the execution
form). On the CPU the reference's float32 weight cannot rebuild the codes: the parameters stay.

Nothing here imports an engine. :class:`FourSightLinearMethodBase`, at the end, is the linear method
both engine adapters mix into theirs (``vllm_method.py``, ``sglang_method.py``, with
:class:`foursight.quant_methods.config.FourSightMethodConfig` for the config): its hooks do four thin
things and call the plan for everything else:

1. **create_weights**: build a :class:`LayerPlan` (``LayerPlan.for_layer``), then for each
   :class:`~foursight.quant_methods.layer_layout.ParamSpec` of ``plan.param_specs(params_dtype)`` register a parameter of that shape /
   dtype with the spec's ``attrs`` (``input_dim``/``output_dim``/``packed_dim``/``packed_factor``)
   and the loader ``plan.make_loader(spec, engine_loader)`` (``engine_loader`` is the layer's own
   column/row/QKV/merged loader; the plan wraps it with dtype checks, error messages that name
   the checkpoint tensor, and bookkeeping of what was loaded).
2. **process_weights_after_loading**: ``layer.foursight_state = plan.process(params, tp)`` where
   ``params`` maps the spec names to the layer's parameters. It is *idempotent*: it never changes
   the loaded parameters' values, it rebuilds the execution state from them every time (so a
   second call, or a call after a weight reload, cannot double-apply a transform -- the class of
   bug of sglang#30761 / verl#7519); then the checkpoint codes are released where the execution
   form can rebuild them (above).
3. **apply**: ``apply_linear(layer.foursight_state, x, bias)`` → the layer's
   :class:`foursight.dispatch.PreparedLinear` (SpliceGEMM on CUDA, the PyTorch reference on
   CPU; the backend is chosen once, in ``process``).
4. **TP**: pass a :class:`TPContext` whose collectives are the engine's (identity at TP=1).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from foursight.dispatch import PreparedLinear, prepare_linear
from foursight.layer import QuantizedWeight, check_channels
from foursight.nvfp4 import NVFP4Error, global_scale_from_amax
from foursight.quant_methods.config import FourSightMethodConfig
from foursight.quant_methods.layer_layout import WEIGHT, LayerLayout
from foursight.quant_methods.layer_loading import LayerLoading
from foursight.quant_methods.online import OnlineSettings, weight_based_channels
from foursight.quant_methods.requantize import quantize_fused, quantize_shard
from foursight.quant_methods.sharding import TPContext, concat_shards, localize_channels
from foursight.schema import (
    BF16_CHANNELS,
    ENV_CHANNELS_FILE,
    ENV_ONLINE_KEEP_BF16,
    INPUT_GLOBAL_SCALE,
    WEIGHT_BF16,
    WEIGHT_GLOBAL_SCALE,
    WEIGHT_PACKED,
    WEIGHT_SCALE,
    CheckpointError,
    decode_module,
    parse_channel_budget,
)

logger = logging.getLogger("foursight.quant_methods")
#: the weight-based channel fallback warns once per channels file (and once when there is none)
_warned_fallback: set[str] = set()


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
class LayerPlan(LayerLoading, LayerLayout):
    """Everything the core needs to know about one engine linear layer: its layout
    (:class:`~foursight.quant_methods.layer_layout.LayerLayout`: the fields ``prefix`` ... ``online``),
    its loaders and their bookkeeping (:class:`~foursight.quant_methods.layer_loading.LayerLoading`:
    ``loaded`` ... ``requantized``) and, here, its post-load processing. Build one with
    :meth:`LayerPlan.for_layer`."""

    #: the quantizer of a BF16 shard (the RL weight update; :meth:`LayerLoading.load_bf16_shard`): the
    #: Triton kernel on CUDA, the PyTorch encoder elsewhere
    quantize_shard = staticmethod(quantize_shard)
    #: the backend that prepares and runs this layer (``foursight.dispatch.LinearBackend``); None: chosen
    #: by ``foursight.dispatch.select_backend`` (the reference on CPU tensors, Triton on CUDA). The tests
    #: set the Triton backend to run the fragment form on the CPU under the Triton interpreter.
    backend: Any = None
    #: True where the engine offloads weights to the CPU (vLLM's ``cpu_offload_gb`` / prefetch offloaders): there
    #: the parameters are the weights the offloader copies back after processing and streams every forward,
    #: so :meth:`release` leaves them (and they take no GPU memory to begin with)
    keep_checkpoint: bool = False

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
        self.restore_released(params)  # nothing reads a freed parameter
        if self.bf16_released:
            raise CheckpointError(f"{self.prefix}: its BF16 weights were freed after quantization ({ENV_ONLINE_KEEP_BF16}=0), so it cannot be "
                                  "quantized again; start the engine without that setting to load or update weights")
        self.generation += 1
        if self.mode == "online":
            qw, igs, channels = self._quantize_online(params[WEIGHT], tp)
        else:
            if check_complete:
                miss = self.missing(self.param_specs())
                if miss:
                    raise CheckpointError(f"missing tensor {miss[0]}" + (f" (and {len(miss) - 1} more)" if len(miss) > 1 else ""))
            qw, igs, channels = self._from_checkpoint(params)
        return LayerState(qw, prepare_linear(qw, self.prefix, backend=self.backend), igs, self.act_quant, channels, self.generation)

    def release(self, params: dict[str, torch.Tensor], state: LayerState) -> int:
        """Free the storage of the ``weight_packed`` / ``weight_scale`` parameters when ``state``'s
        execution form rebuilds them exactly (``foursight.kernels.backends.rebuilds_checkpoint``) and holds
        none of their storage; their shapes, the parameter objects and their loaders stay, so the engine
        still sees them. Returns the bytes freed (0 when they stay: online mode, the CPU reference, an
        experimental backend, or already released)."""
        from foursight.kernels.backends import rebuilds_checkpoint  # plain Python: no Triton import

        form = state.prepared.state
        if self.mode == "online":
            return self._release_online_bf16(params, form)
        if self.keep_checkpoint or self.released is not None or not rebuilds_checkpoint(form):
            return 0
        held: list[torch.Tensor] = []
        _state_tensors(form, held, set())
        held_storages = {t.untyped_storage().data_ptr() for t in held}
        storages = {name: params[name].untyped_storage() for name in (WEIGHT_PACKED, WEIGHT_SCALE)}
        if any(st.data_ptr() in held_storages for st in storages.values()):
            return 0  # the execution form reads them: they are its copy, not a second one
        if not all(st.resizable() for st in storages.values()):
            return 0  # memory the engine mapped itself (vLLM's UVA weight offloading): left as it is
        self.released_bytes = {name: st.nbytes() for name, st in storages.items()}
        for st in storages.values():
            st.resize_(0)
        self.released = form
        return sum(self.released_bytes.values())

    def _release_online_bf16(self, params: dict[str, torch.Tensor], form: Any) -> int:
        """Online mode with ``keep_bf16`` off (``FOURSIGHT_ONLINE_KEEP_BF16=0``): free the BF16 ``weight``'s storage
        once the execution form holds the quantized layer (it keeps its own copy of ``W[:, S]``); the parameter
        object and its shape stay, and its loader refuses further writes (:meth:`LayerLoading.make_loader`)."""
        if self.online is None or self.online.keep_bf16 or self.keep_checkpoint or self.bf16_released:
            return 0
        held: list[torch.Tensor] = []
        _state_tensors(form, held, set())
        st = params[WEIGHT].untyped_storage()
        if st.data_ptr() in {t.untyped_storage().data_ptr() for t in held} or not st.resizable():
            return 0  # the execution form reads it, or the engine mapped it itself
        n = st.nbytes()
        st.resize_(0)
        self.bf16_released = True
        return n

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


def layer_params(layer: Any, plan: LayerLayout) -> dict[str, torch.Tensor]:
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


def restore_layer(layer: Any) -> None:
    """Give a layer its released checkpoint parameters back (:meth:`LayerPlan.release`), for an engine
    route that writes them without their loaders (SGLang's ``load_format="direct"``); a no-op otherwise."""
    plan = layer.foursight_plan
    plan.restore_released(layer_params(layer, plan))


def refresh_layer(layer: Any, tp: TPContext | None = None) -> LayerState:
    """Re-process a layer from its parameters (:meth:`LayerPlan.process`), install the state in
    place (:func:`install_state`) and clear its stale marks; the one re-quantization step of every
    route (the engines' post-load hook, a stale layer's next forward, a completed BF16 sync)."""
    plan = layer.foursight_plan
    params = layer_params(layer, plan)
    install_state(layer, plan.process(params, tp))
    plan.stale = False
    plan.pending_weight.clear()
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
        plan = LayerPlan.for_layer(self.prefix, output_partition_sizes, input_size, input_size_per_partition, qc.fs_config,
                                   qc.packed_mapping(), tp_rank=tp.rank, tp_size=tp.size, mode=qc.mode, online=qc.online)
        engine_loader = extra_weight_attrs.pop("weight_loader", None)
        for spec in plan.param_specs(params_dtype):
            p = torch.nn.Parameter(plan.initial_tensor(spec), requires_grad=False)
            core = plan.make_loader(spec, engine_loader, lambda: layer_params(layer, plan))
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
            if layer.foursight_state is not None and plan.weight_complete():
                refresh_layer(layer, self.tp_context(layer))

        return weight_loader

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Validate and build the execution state from the loaded parameters, when the layer has
        none yet or a tensor was loaded since the last build (idempotent; the parameters' values never
        change, so a second call or a call after a weight reload is safe; their codes may then be
        released, :meth:`LayerPlan.release`)."""
        plan: LayerPlan = layer.foursight_plan
        plan.keep_checkpoint = self.keeps_checkpoint()
        if layer.foursight_state is None or plan.stale:
            refresh_layer(layer, self.tp_context(layer))

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if layer.foursight_plan.stale:  # part of a fused layer was synced and no post-load step ran
            refresh_layer(layer, self.tp_context(layer))
        return apply_linear(layer.foursight_state, x, bias)
