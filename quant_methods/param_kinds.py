"""The kinds of parameter a FourSight engine layer registers, each with its own loading rule (as vLLM's
parameter classes carry theirs, ``vllm/model_executor/parameter.py``). Part of the per-layer plan
(:mod:`foursight.quant_methods.plan`): the plan lists its parameters as instances of these kinds
(``param_specs``), and its loader (:class:`foursight.quant_methods.layer_loading.LayerLoader`) checks the
dtype, asks the kind to write, then keeps the books from what the kind says a load covers.

A checkpoint-mode layer (a FourSight checkpoint), per fused layer (N = sum of the local output
shards, K_loc = the local input size, k = BF16 channels, S = number of shards, e.g. 3 for q/k/v;
the shapes are the checkpoint format's table, ``schema.expected_shapes``):

============================  ====================  ===========  =====================================
name                          shape                 dtype        kind (loading rule)
============================  ====================  ===========  =====================================
``weight``                    [0]                   model dtype  :class:`BF16UpdateParam`: quantizes a
                                                                 BF16 shard into the tensors below
``weight_packed``             [N, K_loc/2]          uint8        :class:`RowsParam` (engine loader;
                                                                 output_dim 0, input_dim 1, packed 2)
``weight_scale``              [N, K_loc/16]         float8_e4m3  :class:`RowsParam` (output_dim 0, input_dim 1)
``weight_bf16``               [N, k]                bfloat16     :class:`RowsParam` (output_dim 0; never
                                                                 split along K: kept whole, see TP)
``weight_global_scale``       [S]                   float32      :class:`PerShardParam` (row ``shard_id``)
``input_global_scale``        [S]                   float32      :class:`PerShardParam`
``bf16_channels``             [S, k]                int32        :class:`PerShardParam`; all rows must match
============================  ====================  ===========  =====================================

An online-mode layer (a BF16 checkpoint quantized at load) has one :class:`BF16WeightParam` ``weight``
[N, K_loc] in the model dtype, loaded by the engine's loader.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Sequence

import torch

from foursight.schema import BF16_CHANNELS, WEIGHT_BF16, CheckpointError, encode_module

if TYPE_CHECKING:  # annotations only: the loader passes itself in a LoadCall
    from foursight.layer import QuantizedWeight
    from foursight.quant_methods.layer_loading import LayerLoader


@dataclass(frozen=True)
class LoadCall:
    """One call of a parameter's weight loader, as the layer's loader hands it to the parameter's kind.

    Attributes:
        loader: the layer's loader (its layout, what it loaded so far).
        param, weight, shard_id, args, kw: the engine's call (``loader(param, weight, shard_id, *args, **kw)``).
        idx: ``shard_id`` as a shard index (0 for None).
        tensor: the checkpoint name of ``weight`` (for error messages).
        engine_loader: the engine's column/row/fused loader of the layer, or None.
        layer_params: the layer's parameters by name (the BF16 update writes the checkpoint tensors), or None.
    """

    loader: LayerLoader
    param: torch.Tensor
    weight: torch.Tensor
    shard_id: Any
    idx: int
    tensor: str
    engine_loader: Callable | None = None
    layer_params: Callable[[], dict[str, torch.Tensor]] | None = None
    args: tuple = ()
    kw: dict[str, Any] = field(default_factory=dict)


@dataclass
class ParamSpec:
    """One parameter an engine registers in ``create_weights``; a subclass is its kind and loading rule.

    Attributes:
        name: attribute name on the layer (= checkpoint tensor suffix).
        shape, dtype: allocation.
        attrs: engine weight attributes (``input_dim``, ``output_dim``, ``packed_dim``, ``packed_factor``);
            the engine adds its ``weight_loader``.
        fill: value of a fresh parameter (1.0 for scales, so an unloaded layer is still finite).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    attrs: dict[str, Any] = field(default_factory=dict)
    fill: float = 0.0

    #: a BF16 ``weight``: any float dtype is taken, and a load counts toward the layer's pending weight
    bf16_weight: ClassVar[bool] = False

    def initial_tensor(self) -> torch.Tensor:
        """A fresh tensor filled with :attr:`fill`, for the engine to wrap as a parameter."""
        return torch.full(self.shape, self.fill, dtype=torch.float32).to(self.dtype)

    def check_dtype(self, weight: torch.Tensor, tensor: str) -> None:
        if weight.dtype != self.dtype:
            raise CheckpointError(f"tensor {tensor} has dtype {weight.dtype}, expected {self.dtype}")

    def load(self, call: LoadCall) -> None:
        """Write ``call.weight`` into the layer (raises CheckpointError naming ``call.tensor``)."""
        raise NotImplementedError

    def covers(self, shard_id: Any, idx: int, num_shards: int) -> Sequence[int]:
        """The shards a load of this parameter counts as loaded (empty: not a checkpoint tensor)."""
        return (idx,)

    def required(self, static_act_scale: bool) -> bool:
        """Whether a complete checkpoint holds this tensor for every shard."""
        return True


@dataclass
class RowsParam(ParamSpec):
    """One row per output row (``weight_packed``, ``weight_scale``, ``weight_bf16``): the engine's own loader
    writes it, split as :attr:`attrs` say; a whole (``shard_id`` None) load covers every shard."""

    def load(self, call: LoadCall) -> None:
        if call.engine_loader is None:
            raise RuntimeError(f"{call.loader.layout.prefix}: no engine loader for {self.name}")
        try:
            if call.shard_id is None:
                call.engine_loader(call.param, call.weight, *call.args, **call.kw)
            else:
                call.engine_loader(call.param, call.weight, call.shard_id, *call.args, **call.kw)
        except (AssertionError, RuntimeError, IndexError) as e:
            raise CheckpointError(
                f"tensor {call.tensor} has shape {list(call.weight.shape)}, which does not fit parameter "
                f"{call.loader.layout.prefix}.{self.name} of local shape {list(call.param.shape)} (shard {call.shard_id!r}): {e}"
            ) from None

    def covers(self, shard_id: Any, idx: int, num_shards: int) -> Sequence[int]:
        return range(num_shards) if shard_id is None else (idx,)


@dataclass
class BF16WeightParam(RowsParam):
    """The online-mode BF16 ``weight`` [N, K_loc]: the engine's loader writes it; any float dtype."""

    bf16_weight: ClassVar[bool] = True

    def check_dtype(self, weight: torch.Tensor, tensor: str) -> None:
        if not weight.is_floating_point():
            raise CheckpointError(f"tensor {tensor} has dtype {weight.dtype}, expected a float dtype")


@dataclass
class PerShardParam(ParamSpec):
    """One row per fused shard (the per-tensor scales [S], ``bf16_channels`` [S, k]), as vLLM's
    ``PerTensorScaleParameter``: the shard's own row is written here, not by the engine's loader.
    ``input_global_scale`` is only required with static activation scales (:attr:`static_only`)."""

    static_only: bool = False

    def load(self, call: LoadCall) -> None:
        row, loaded = call.param.data[call.idx], call.weight
        if row.dim() == 0:  # per-shard scalar: the checkpoint holds [1] (or a bare scalar)
            if tuple(loaded.shape) not in ((), (1,)):
                raise CheckpointError(f"tensor {call.tensor} has shape {list(loaded.shape)}, expected [1]")
            row.copy_(loaded.reshape(()))
            return
        if tuple(loaded.shape) != tuple(row.shape):
            raise CheckpointError(f"tensor {call.tensor} has shape {list(loaded.shape)}, expected {list(row.shape)}")
        row.copy_(loaded)

    def required(self, static_act_scale: bool) -> bool:
        return static_act_scale or not self.static_only


@dataclass
class BF16UpdateParam(BF16WeightParam):
    """The empty ``weight`` [0] of a checkpoint-mode layer. It holds nothing and is never part of the
    checkpoint; it exists so that the engine's own ``load_weights`` finds a parameter for a BF16
    ``<module>.weight`` (an RL weight sync) and calls its loader, which quantizes the shard with the
    layer's loaded channel set into the layer's checkpoint tensors (:meth:`load`).

    Attributes:
        quantize: ``quantize(weight, channels, name=...) -> QuantizedWeight``, the sync's quantizer
            (:func:`foursight.quant_methods.requantize.quantize_shard`: Triton on CUDA, PyTorch elsewhere).
    """

    quantize: Callable[..., QuantizedWeight] | None = None

    def load(self, call: LoadCall) -> None:
        """Quantize one BF16 shard ``<shard>.weight`` (the learner's full, unsharded HF tensor, as
        ``load_weights`` passes it) with the layer's current channel set into the checkpoint tensors
        of that shard, and load those through the layer's own loaders (so TP slicing is the engine's,
        as for a fresh checkpoint load). The static activation scale (``input_global_scale``) is
        calibration, not weight: it is kept. The result equals a fresh load of a checkpoint quantized
        from the same weights with the same channels; the shard is marked requantized.

        Raises CheckpointError naming the tensor for a non-2-D or non-finite weight, a wrong K, a layer
        whose channels were never loaded, or a fused tensor given whole (give the shards).
        """
        loader, weight, shard_id, idx = call.loader, call.weight, call.shard_id, call.idx
        lay = loader.layout
        if call.layer_params is None or self.quantize is None:
            raise RuntimeError(f"{lay.prefix}: no parameters to quantize {call.tensor} into")
        if shard_id is None and lay.num_shards > 1:
            raise CheckpointError(f"tensor {lay.prefix}.weight: a fused weight given whole; load its shards "
                                  f"({', '.join(n.rpartition('.')[2] for n in lay.shard_names)}) by their own names")
        shard = lay.shard_names[idx]
        if weight.dim() != 2 or weight.shape[1] != lay.input_size:
            raise CheckpointError(f"tensor {shard}.weight has shape {list(weight.shape)}; layer {lay.prefix} expects [rows, {lay.input_size}]")
        if (BF16_CHANNELS, idx) not in loader.loaded:
            raise CheckpointError(f"tensor {shard}.weight: layer {lay.prefix} has no channel set loaded yet (load the checkpoint first)")
        params = call.layer_params()
        channels = params[BF16_CHANNELS].data[idx].to(weight.device)
        # a fresh load casts a checkpoint's tensors to the engine's dtype before anything else; a float32
        # learner (TRL colocate hands its parameters over as they are) must be rounded the same way
        qw = self.quantize(weight.to(params[WEIGHT_BF16].dtype), channels, name=shard)
        for key, t in encode_module(shard, qw).items():
            p = params[key.rpartition(".")[2]]
            if shard_id is None:
                p.weight_loader(p, t)
            else:
                p.weight_loader(p, t, shard_id)
        loader.requantized.add(idx)

    def covers(self, shard_id: Any, idx: int, num_shards: int) -> Sequence[int]:
        return ()  # the checkpoint tensors' own loaders recorded the load

    def required(self, static_act_scale: bool) -> bool:
        return False
