"""How one weight update is applied to a running vLLM engine's model, whichever road brought it.

Every vLLM road runs :func:`run_update` (or the two steps of its :class:`UpdateSession`): the in-memory
:func:`apply_weight_update` (a colocated trainer), the worker extension's file route
(:meth:`foursight.quant_methods.vllm_weight_sync.FourSightWorkerExtension.foursight_update_weights`), the
native weight-transfer backend (:mod:`foursight.quant_methods.vllm_weight_transfer`) and the broadcast road
(:mod:`foursight.quant_methods.weight_broadcast`). The worker extension that exposes it over
``collective_rpc``, and the guards of vLLM's own weight RPCs, are in :mod:`foursight.quant_methods.vllm_weight_sync`.

The steps of an update:

0. check the whole update once (:class:`UpdateSession`: names, dtypes, shapes, every value finite; a
   file is read without a separate finiteness pass, the check reads every value);
1. read the BF16 tensors (HF names, e.g. ``model.layers.0.self_attn.q_proj.weight``) from a
   safetensors file;
2. for FourSight layers loaded from a *quantized checkpoint* (they hold no BF16 weight), each
   ``<module>.weight`` is quantized here into the checkpoint tensors (``weight_packed``,
   ``weight_scale``, ``weight_global_scale``, ``bf16_channels``, ``weight_bf16``) with the layer's
   current channel set; for layers in *online* mode and every other parameter (norms,
   embeddings, lm_head, biases) the tensor goes through unchanged;
3. everything is loaded through the model's own ``load_weights`` (vLLM's name mapping, fused
   q/k/v and gate/up shards, TP slicing); unquantized linear layers whose weight vLLM's CPU
   backend pre-packed (the parameter is left empty) get their model-format parameter back
   through vLLM's layerwise reload first and are re-packed once all their elements arrived
   (:func:`cpu_packed_linears`). Such a layer cannot take some shards of a fused layer alone
   (its other shards' model-format weights are gone): an update that gives only some is refused,
   naming the layer, which keeps its previous weights (:class:`FusedShardGate`; the single-file
   ``foursight_update_weights`` checks the file's names before it loads anything, so a refused
   file changes nothing). Every other layer, FourSight ones included, takes a partial update;
4. the idempotent post-load processing (``LayerPlan.process``) of every FourSight layer that
   received a tensor rebuilds its quantized execution state (online layers re-quantize their
   BF16 weight; with the weight-based channel fallback the channels are re-selected from the
   new weights, so an update equals a fresh load of the same weights).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch

from foursight.quant_methods.config import foursight_layers
from foursight.quant_methods.param_names import vllm_name_map
from foursight.quant_methods.update_check import UpdateChecker, unchecked_load_weights
from foursight.schema import CheckpointError


def check_update(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Validate a WHOLE update before anything of it is loaded (issue 28: atomic updates):
    :func:`foursight.quant_methods.update_check.check_update` with vLLM's name mapping
    (:func:`~foursight.quant_methods.param_names.vllm_name_map`) and BF16 weights only (every tensor a finite float). Raises
    CheckpointError naming the first bad tensor; returns the number of tensors. A refused update
    therefore leaves the engine as it was. (:class:`UpdateSession` runs the same check, its checker built once per update.)
    """
    from foursight.quant_methods.update_check import check_update as check

    return check(model, weights, map_name=vllm_name_map(model))


def cpu_packed_linears(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Unquantized linear layers whose weight vLLM's CPU backend moved into a pre-packed GEMM
    (``dispatch_cpu_unquantized_gemm(remove_weight=True)`` leaves ``weight`` as an empty tensor).

    A plain ``load_weights`` cannot write into them; :func:`begin_update` gives them back their
    model-format parameters through vLLM's own layerwise reload (``model_loader.reload``), which
    re-runs their post-load step (the re-pack) once every element of the layer has arrived.
    Empty on GPU, and for FourSight layers (they keep their tensors).
    """
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

    out = {}
    for n, m in model.named_modules():
        w = getattr(m, "weight", None)
        if (isinstance(m, LinearBase) and isinstance(getattr(m, "quant_method", None), UnquantizedLinearMethod)
                and isinstance(w, torch.Tensor) and w.numel() == 0 and not w.is_meta):
            out[n] = m
    return out


def _open_packed_for_reload(layers: dict[str, torch.nn.Module]) -> None:
    """vLLM's ``initialize_layerwise_reload`` for the given layers only: keep the kernel tensors,
    put the recorded model-format parameters back (on meta) and buffer their loads."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info, initialize_online_processing
    from vllm.model_executor.model_loader.reload.meta import restore_layer_on_meta
    from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers

    for n, layer in layers.items():
        info = get_layerwise_info(layer)
        if "weight" not in info.restore_metadata[0]:
            raise RuntimeError(f"{n}: vLLM recorded no model-format metadata for this layer; it cannot be reloaded")
        if info.can_load():  # a previous update that failed half-way: start it over
            info.reset()
        info.kernel_tensors = get_layer_params_buffers(layer)
        info.kernel_non_persistent_buffers = set(layer._non_persistent_buffers_set)
        restore_layer_on_meta(layer, info)
        initialize_online_processing(layer)


def _close_packed_reload(layers: dict[str, torch.nn.Module]) -> list[str]:
    """Finish the layerwise reload of :func:`_open_packed_for_reload`. A fully loaded layer was
    already re-packed by its wrapped loader; an untouched one gets its kernel tensors back. A
    layer that received only some of its elements (say ``q_proj`` but not ``k_proj``/``v_proj``
    of a fused ``qkv_proj``) also keeps its old kernel tensors; its name is returned."""
    from vllm.model_executor.model_loader.reload.layerwise import _get_original_loader, _place_kernel_tensors, get_layerwise_info
    from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

    partial = []
    for n, layer in layers.items():
        info = get_layerwise_info(layer)
        if not info.can_load():  # processed during the load
            continue
        if info.load_numel > 0:
            partial.append(f"{n} ({info.load_numel} of {info.load_numel_total} elements)")
        for t in get_layer_tensors(layer).values():
            t.weight_loader = _get_original_loader(t)
        _place_kernel_tensors(layer, info)
        info.reset()
    return partial


class FusedShardGate:
    """Holds back the shards of a fused layer (``q_proj``/``k_proj``/``v_proj`` of ``qkv_proj``,
    ``gate_proj``/``up_proj`` of ``gate_up_proj``: the model's ``packed_modules_mapping``) until
    every shard of it has arrived in the update, then lets them through together.

    Only the fused layers in ``only`` are gated (all of them when None): the engine uses it for
    the CPU-packed unquantized layers (:func:`cpu_packed_linears`), the one kind that cannot take
    some shards alone, since vLLM's CPU backend dropped their model-format weight when it
    re-packed it (oneDNN on AVX-512 BF16 hosts; an AVX2 host falls back to ``F.linear`` and keeps
    it). FourSight layers and kept weights load a single shard fine. A gated layer whose update
    gives only some shards writes none of them: :meth:`incomplete` names what is left at the end,
    and :func:`finish_update` refuses the update. The shards may come in any order and across
    several ``update_weights`` calls of the native API (a sharded state dict may split a layer
    over two files); only the shards still waiting for their siblings are held in memory.
    """

    def __init__(self, model: torch.nn.Module, only: Iterable[str] | None = None) -> None:
        mapping = getattr(model, "packed_modules_mapping", None) or {}
        self._fused = {shard: (fused, tuple(shards)) for fused, shards in mapping.items()
                       if len(shards) > 1 for shard in shards}
        self._only = None if only is None else set(only)
        self._pending: dict[tuple[str, str], dict[str, tuple[str, torch.Tensor]]] = {}

    def admit(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in weights:
            mod, _, param = name.rpartition(".")
            prefix, _, leaf = mod.rpartition(".")
            if leaf not in self._fused:
                yield name, t
                continue
            fused, shards = self._fused[leaf]
            key = (f"{prefix}.{fused}" if prefix else fused, param)
            if self._only is not None and key[0] not in self._only:
                yield name, t
                continue
            got = self._pending.setdefault(key, {})
            got[leaf] = (name, t)
            if len(got) == len(shards):
                del self._pending[key]
                for s in shards:
                    yield got[s]

    def incomplete(self) -> list[str]:
        """One line per fused layer still missing shards, e.g.
        ``model.layers.0.self_attn.qkv_proj.weight (got q_proj; missing k_proj, v_proj)``."""
        out = []
        for (fused, param), got in sorted(self._pending.items()):
            shards = self._fused[next(iter(got))][1]
            out.append(f"{fused}.{param} (got {', '.join(s for s in shards if s in got)}; "
                       f"missing {', '.join(s for s in shards if s not in got)})")
        return out


def _partial_fused_error(partial: list[str]) -> CheckpointError:
    return CheckpointError(
        "the update gave only part of these fused layers, which therefore keep their previous weights: "
        + ", ".join(partial) + "; send every shard of a fused layer (q/k/v, gate/up) in one update")


def check_fused_complete(model: torch.nn.Module, names: Iterable[str]) -> None:
    """Refuse, before anything is loaded, an update whose tensor ``names`` give only some shards
    of a CPU-packed fused layer (:class:`FusedShardGate`); raises CheckpointError naming the layers."""
    gate = FusedShardGate(model, only=cpu_packed_linears(model))
    for _ in gate.admit((n, None) for n in names):
        pass
    if gate.incomplete():
        raise _partial_fused_error(gate.incomplete())


@dataclass
class LoadProgress:
    """What one update's load needs from :func:`begin_update` to :func:`finish_update`.

    Attributes:
        layers: the FourSight layers of the model, by name.
        before: each layer's ``load_events`` when the update began (a layer whose count moved received a tensor).
        packed: the CPU-packed unquantized linears opened for reloading (:func:`cpu_packed_linears`).
        gate: the fused-shard gate of those layers (:class:`FusedShardGate`).
        count: tensors handed to ``load_weights`` so far.
    """

    layers: dict[str, torch.nn.Module]
    before: dict[str, int]
    packed: dict[str, torch.nn.Module]
    gate: FusedShardGate
    count: int = 0


def begin_update(model: torch.nn.Module) -> LoadProgress:
    """Start one weight update's load: remember each FourSight layer's load count (what
    :func:`finish_update` compares against to find the layers that received a tensor) and open
    the CPU-packed unquantized layers for reloading (:func:`cpu_packed_linears`)."""
    layers = foursight_layers(model)
    packed = cpu_packed_linears(model)
    _open_packed_for_reload(packed)
    return LoadProgress(layers=layers, before={n: m.foursight_plan.loader.load_events for n, m in layers.items()},
                        packed=packed, gate=FusedShardGate(model, only=packed))


def load_update(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]], progress: LoadProgress) -> int:
    """Load ``(HF name, tensor)`` pairs through the model's ``load_weights`` (steps 2-3 of the
    module docstring), within a :func:`begin_update` load; returns the number of tensors."""
    n0 = progress.count

    def counted(it):
        for item in it:
            progress.count += 1
            yield item

    # the update's session checked the whole update before its load began: skip the per-call guard
    unchecked_load_weights(model)(weights=counted(progress.gate.admit(weights)))
    return progress.count - n0


def finish_update(model: torch.nn.Module, progress: LoadProgress) -> dict:
    """Re-run the idempotent post-load processing of every layer that received a tensor in the
    load, and the CPU embedding re-pack (step 4). Returns ``{"updated_tensors", "requantized_layers"}``."""
    partial = progress.gate.incomplete() + _close_packed_reload(progress.packed)
    layers, before = progress.layers, progress.before
    touched = [n for n, m in layers.items() if m.foursight_plan.loader.load_events != before[n]]
    for n in touched:
        m = layers[n]
        if m.foursight_plan.loader.stale:  # a layer whose every shard arrived was re-quantized in its loader
            m.quant_method.process_weights_after_loading(m)  # refresh_layer with the layer's TP group (its method's tp_context)
    refresh_unquantized_embeddings(model)
    if partial:
        raise _partial_fused_error(partial)
    return {"updated_tensors": progress.count, "requantized_layers": len(touched)}


@dataclass
class UpdateSession:
    """One weight update of a vLLM engine, whichever road brought it: the in-memory
    :func:`apply_weight_update`, the worker's file route
    (:meth:`~foursight.quant_methods.vllm_weight_sync.FourSightWorkerExtension.foursight_update_weights`)
    and the native weight-transfer backend (:mod:`foursight.quant_methods.vllm_weight_transfer`, whose update
    arrives in several files over several calls) all run it, through :func:`run_update` or its two steps.

    :meth:`receive` checks each part of the update once (names, dtypes, shapes, every value finite:
    :class:`~foursight.quant_methods.update_check.UpdateChecker` with vLLM's name mapping, built once per
    update) and keeps the tensors it checked; :meth:`apply` refuses an update with a refused part or half a
    CPU-packed fused layer (:func:`check_fused_complete`), then loads every part, in order, and re-quantizes
    (:func:`begin_update`, :func:`load_update`, :func:`finish_update`). Nothing is loaded before every part
    passed, so a refused update leaves the engine as it was; what is loaded is what was checked (a file
    rewritten after it was read changes nothing).

    Attributes:
        model: the engine's model.
        parts: the checked ``(HF name, tensor)`` lists, in arrival order.
        refused: why a part was refused (the whole update is then refused), or None.
    """

    model: torch.nn.Module
    parts: list[list[tuple[str, torch.Tensor]]] = field(default_factory=list)
    refused: str | None = None
    _checker: UpdateChecker | None = field(default=None, repr=False)

    def receive(self, weights: Iterable[tuple[str, torch.Tensor]], where: str = "") -> int:
        """Read ``weights`` (an iterator is read once, e.g. :func:`foursight.tensor_io.iter_safetensors` with
        ``check=False``: the finiteness check is here), check every tensor and keep them; returns their number.
        Raises CheckpointError naming the first bad tensor (and ``where``, e.g. the file), or the reader's
        error, and marks the update refused."""
        try:
            items = list(weights)
            if self._checker is None:
                self._checker = UpdateChecker(self.model, map_name=vllm_name_map(self.model))
            self._checker.check(items, where)
        except Exception as e:
            self.refused = str(e)
            raise
        self.parts.append(items)
        return len(items)

    def names(self) -> list[str]:
        """The names of every tensor received so far."""
        return [n for part in self.parts for n, _ in part]

    def apply(self) -> dict:
        """Load every received part and re-quantize (module docstring, steps 2-4). Raises RuntimeError when a
        part was refused and CheckpointError for half a CPU-packed fused layer, both before anything is loaded.
        Returns ``{"updated_tensors", "requantized_layers"}``."""
        if self.refused is not None:
            raise RuntimeError(f"the update was refused, nothing of it is loaded ({self.refused})")
        check_fused_complete(self.model, self.names())
        with torch.no_grad():
            progress = begin_update(self.model)
            for part in self.parts:
                load_update(self.model, part, progress)
            return finish_update(self.model, progress)


def run_update(model: torch.nn.Module, parts: Iterable[Iterable[tuple[str, torch.Tensor]]],
               refusal: Callable[[Exception], Exception] | None = None, where: str = "") -> dict:
    """One weight update from start to end: every part received (read and checked once:
    :meth:`UpdateSession.receive`), the fused layers checked complete, then loaded and re-quantized
    (:meth:`UpdateSession.apply`). ``refusal`` turns an error found before anything is loaded (a bad
    tensor, an unreadable file, half a CPU-packed fused layer) into the exception the caller raises
    (the worker's :class:`~foursight.quant_methods.weight_authority.RefusedUpdate`, which the bridge
    answers with 422); None raises it as it is; ``where`` (e.g. the file) is named in a bad tensor's error. Returns ``{"updated_tensors", "requantized_layers"}``."""
    session = UpdateSession(model)
    try:
        for part in parts:
            session.receive(part, where)
        check_fused_complete(model, session.names())
    except Exception as e:
        if refusal is None:
            raise
        raise refusal(e) from e
    return session.apply()


def apply_weight_update(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> dict:
    """Load new BF16 weights into a FourSight vLLM model and re-quantize the touched layers
    (:func:`run_update` of one part).

    Args:
        model: the engine's model (``worker.model_runner.model``).
        weights: ``(HF name, tensor)`` pairs.
    Returns:
        ``{"updated_tensors": int, "requantized_layers": int}``.
    Raises:
        CheckpointError naming the first bad tensor (name, dtype, shape, finiteness) or the fused layer of
        which it gives only some shards (:func:`check_fused_complete`), before anything is loaded: a
        refused update leaves the engine as it was.
    """
    return run_update(model, [weights])


def refresh_unquantized_embeddings(model: torch.nn.Module) -> int:
    """Re-run the post-load step of the unquantized embedding / lm_head layers.

    On CPU vLLM pre-packs their weights for its GEMM (``dispatch_cpu_unquantized_gemm``, the
    weight itself is kept), so a new ``embed_tokens``/``lm_head`` weight (or a tied one) is only
    used after this; the step is idempotent and a no-op on GPU. Returns the number of layers.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    n = 0
    for m in model.modules():
        qm = getattr(m, "quant_method", None)
        if isinstance(qm, UnquantizedEmbeddingMethod) and getattr(m, "weight", None) is not None and m.weight.numel():
            qm.process_weights_after_loading(m)
            n += 1
    return n
