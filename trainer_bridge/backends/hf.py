"""The HF backend: a Hugging Face causal LM in this process (BF16, FP8 rowwise, or a FourSight
checkpoint through :mod:`foursight.hf`).

:class:`HFEngine` serves the bridge and ``foursight compare``: a round-robin scheduler shares the
model between requests, each sample with its own KV cache, and tokens are chosen by the one HF
sampler (:mod:`foursight.trainer_bridge.hf_sampling`). :class:`~.hf_rollout.HFRollout`
(``foursight rl``'s in-process rollout copy of the learner) is synced through
:meth:`HFEngine.load_tensors_sync`.

Numerics of a FourSight-quantized model live in :mod:`foursight.layer` / :mod:`foursight.hf`;
a weight update re-quantizes through ``FourSightLinear.set_weight`` and never duplicates them.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import copy
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from foursight.trainer_bridge import hf_sampling
from foursight.trainer_bridge.backends.base import Delta, Engine, EngineError, LocalTokenizer, UpdateRefused
from foursight.trainer_bridge.protocol import Rollout, SamplingParams


class _HFSample:
    """One sample of the HF engine's round-robin scheduler: its own KV cache and generator."""

    def __init__(self, prompt_ids, params, max_tokens, seed, eos, cancel, decode=None, group: Any = None):
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.params = params
        self.max_tokens = int(max_tokens)
        self.seed = seed
        self.eos = eos
        self.cancel = cancel
        self.decode = decode  # token ids -> text, for stop strings
        # the scheduler's round-robin is over groups (bridge requests), then over a group's samples;
        # a sample without a request is a group of its own
        self.group = group if group is not None else ("sample", id(self))
        self.gen: Any = None  # its own generator (hf_sampling.sample_generator), made at the prefill on the model's device
        self.cache: Any = None
        self.next_logits: Any = None
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        #: each token's top alternatives and the prompt's logprobs, when ``params`` asks for them (``Delta``)
        self.top_logprobs: list[list[tuple[int, float]]] | None = [] if params.logprobs else None
        self.prompt_logprobs: list[list[tuple[int, float]] | None] | None = None
        self.finish_reason: str | None = None
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        #: called by the scheduler thread after each turn (``HFEngine.generate_stream`` wakes its reader)
        self.on_turn: Any = None


def _alternatives(logprobs: torch.Tensor, token: int, k: int) -> list[tuple[int, float]]:
    """``(id, logprob)`` of ``token`` and the ``k`` most likely tokens after it (once each), as vLLM orders them."""
    vals, ids = torch.topk(logprobs, k) if k else (logprobs[:0], logprobs[:0].long())
    return [(token, float(logprobs[token]))] + [(int(i), float(v)) for i, v in zip(ids.tolist(), vals.tolist()) if int(i) != token]


def _settle(fut: Any, result: Any = None, exc: BaseException | None = None) -> None:
    """Complete a sample's future unless its caller already cancelled it."""
    try:
        fut.set_exception(exc) if exc is not None else fut.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass


def _hf_sample_step(model: Any, s: _HFSample, n_tokens: int) -> None:
    """Advance one sample by up to ``n_tokens`` tokens (the first call also runs the prefill) with
    the model's own forward and its KV cache (``past_key_values``), each token chosen by
    :func:`~foursight.trainer_bridge.hf_sampling.choose_tokens`; sets ``finish_reason`` when done
    (:func:`~foursight.trainer_bridge.hf_sampling.finish_reason`). The same prompt, parameters and
    seed give the same tokens and logprobs however the sample's steps are interleaved with other samples'."""
    if s.max_tokens <= 0:
        s.finish_reason = "length"
        return
    dev = next(model.parameters()).device
    if s.cache is None:
        s.gen = hf_sampling.sample_generator(s.seed, dev)
        out = model(input_ids=torch.tensor([s.prompt_ids], device=dev), use_cache=True)
        s.cache, s.next_logits = out.past_key_values, out.logits[:, -1, :]
        if s.params.prompt_logprobs is not None:  # raw logprobs of each prompt token after the ones before it
            lp = torch.log_softmax(out.logits[0, :-1].float(), -1)
            s.prompt_logprobs = [None] + [_alternatives(lp[p - 1], s.prompt_ids[p], s.params.prompt_logprobs)
                                          for p in range(1, len(s.prompt_ids))]
    for _ in range(n_tokens):
        if s.cancel is not None and s.cancel.is_set():
            return
        raw = s.next_logits
        tok = hf_sampling.choose_tokens(raw, s.params, [s.prompt_ids + s.token_ids], len(s.token_ids), s.eos, [s.gen])
        s.token_ids.append(int(tok[0]))
        s.logprobs.append(float(hf_sampling.raw_logprobs(raw, tok)[0]))
        if s.top_logprobs is not None:
            s.top_logprobs.append(_alternatives(torch.log_softmax(raw[0].float(), -1), int(tok[0]), s.params.logprobs))
        s.finish_reason = hf_sampling.finish_reason(s.token_ids, s.eos, s.max_tokens, s.params.stop, s.decode)
        if s.finish_reason is not None:
            return
        out = model(input_ids=tok.view(1, 1).to(dev), past_key_values=s.cache, use_cache=True)
        s.cache, s.next_logits = out.past_key_values, out.logits[:, -1, :]


class HFEngine(Engine):
    """A Hugging Face causal LM in this process (CPU or CUDA); requests share it round-robin.

    One scheduler thread serves the active requests in turn and, within a request, its samples in
    turn, ``slice_tokens`` decode steps per turn, each sample with its own KV cache and seeded
    ``torch.Generator`` (:meth:`_run`): a request gets an equal share of the model whatever the
    others ask for (one with ``n=64`` long samples does not slow a one-sample request 64-fold),
    none is starved, and a sample's result does not depend on the others.

    Loads ``model_dir`` as BF16, or, when its ``config.json`` has a FourSight
    ``quantization_config``, as the FourSight reference model (:func:`foursight.hf.load_reference_model`).
    Logprobs are the raw ones (log-softmax of the unprocessed logits, ``raw_logprobs``).
    A weight update copies BF16 tensors in and re-quantizes FourSight layers via ``FourSightLinear.set_weight``.
    """

    kind = "hf"
    atomic_updates = True
    returns_top_logprobs = True

    def __init__(self, model_dir: str | Path | None = None, model: Any = None, tokenizer: str | Path | None = None, device: str = "cpu",
                 slice_tokens: int = 4):
        if (model_dir is None) == (model is None):
            raise EngineError("HFEngine: give exactly one of model_dir, model")
        self.model_dir = Path(model_dir) if model_dir is not None else None
        self.model = model
        self.device = device
        self.name = f"hf@{self.model_dir.name if self.model_dir else type(model).__name__}"
        tok = tokenizer or self.model_dir
        self.tokenizer = LocalTokenizer(tok) if tok else None
        self._lock = threading.Lock()  # the model: one forward (a scheduler turn, a score, an update) at a time
        self._cv = threading.Condition()
        #: active samples by group (bridge request), in round-robin order of the groups
        self._groups: dict[Any, collections.deque[_HFSample]] = {}
        self._current: _HFSample | None = None
        self._worker: threading.Thread | None = None
        #: tokens a sample generates per scheduler turn before the next active sample's turn
        self.slice_tokens = max(1, int(slice_tokens))
        self.logprobs_mode = "raw_logprobs"
        #: weight version of the last update applied in this process (0 after a load)
        self.version = 0
        self.boot_id = uuid.uuid4().hex

    def _load(self) -> None:
        from transformers import AutoModelForCausalLM

        from foursight.schema import read_config

        cfg = read_config(self.model_dir)
        qc = cfg.get("quantization_config") or {}
        if qc.get("quant_method") == "foursight":
            from foursight.hf import load_reference_model

            self.model = load_reference_model(self.model_dir, device=self.device)
            self.name = f"hf-foursight@{self.model_dir.name}"
        else:
            self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.bfloat16).to(self.device).eval()
        # a (re)load serves the folder's weights: a new boot, version 0
        self.version, self.boot_id = 0, uuid.uuid4().hex

    async def start(self) -> None:
        if self.model is None:
            await asyncio.to_thread(self._load)

    def served_model(self) -> str:
        """The model folder as given (``--model``), as vLLM names a model it serves; the engine's name for a model object."""
        return str(self.model_dir) if self.model_dir is not None else self.name

    def _eos_ids(self) -> set[int]:
        return set(hf_sampling.eos_ids(self.model, self.tokenizer.tok if self.tokenizer else None))

    def _push(self, s: _HFSample) -> None:
        """Queue ``s`` at the end of its group (a new group goes to the end of the rotation); under ``_cv``."""
        self._groups.setdefault(s.group, collections.deque()).append(s)

    def _pop(self) -> _HFSample:
        """The next turn: the first sample of the first group; the group moves to the end of the rotation. Under ``_cv``."""
        key = next(iter(self._groups))
        q = self._groups.pop(key)
        s = q.popleft()
        if q:
            self._groups[key] = q
        return s

    def _submit(self, prompt_ids: list[int], params: SamplingParams, max_tokens: int, seed: int | None,
                cancel: threading.Event | None, request: str | None = None, on_turn: Any = None) -> _HFSample:
        eos = self._eos_ids() | set(params.stop_token_ids) if not params.ignore_eos else set(params.stop_token_ids)
        if params.stop and self.tokenizer is None:
            raise EngineError(f"{self.name}: stop strings need a tokenizer (pass --tokenizer or --model)")
        decode = self.tokenizer.tok.decode if self.tokenizer is not None else None
        s = _HFSample(prompt_ids, params, max_tokens, seed, eos, cancel, decode, group=request)
        s.on_turn = on_turn
        with self._cv:
            self._push(s)
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._run, name=f"{self.name}-scheduler", daemon=True)
                self._worker.start()
            self._cv.notify()
        return s

    @property
    def active_samples(self) -> int:
        """Samples submitted and not yet finished, failed or cancelled (the scheduler's queue)."""
        with self._cv:
            return sum(len(q) for q in self._groups.values()) + (self._current is not None)

    def active_progress(self) -> list[int]:
        """Tokens generated so far by each active sample (the one in its turn first, then the queue)."""
        with self._cv:
            queued = [x for q in self._groups.values() for x in q]
            return [len(s.token_ids) for s in ([self._current] if self._current is not None else []) + queued]

    def _run(self) -> None:
        """The scheduler: round-robin over the active requests and, within one, over its samples,
        ``slice_tokens`` tokens per turn.

        A sample takes its turn (prefill + first tokens, or the next slice) under the engine lock
        and goes back to the end of its request's queue, the request to the end of the rotation; a
        cancelled one is dropped before its next turn or at its next token. So a request waits at
        most one slice of each other active request per turn, and a short request does not wait
        for a long one to end."""
        while True:
            with self._cv:
                while not self._groups:
                    self._cv.wait()
                s = self._current = self._pop()
            try:
                if s.future.cancelled() or (s.cancel is not None and s.cancel.is_set()):
                    _settle(s.future, exc=EngineError(f"{self.name}: cancelled after {len(s.token_ids)} tokens"))
                    continue
                try:
                    with self._lock, torch.no_grad():
                        _hf_sample_step(self.model, s, self.slice_tokens)
                except Exception as e:  # noqa: BLE001 - goes to the caller
                    _settle(s.future, exc=e if isinstance(e, EngineError) else EngineError(f"{self.name}: {type(e).__name__}: {e}"))
                    continue
                if s.future.cancelled() or (s.cancel is not None and s.cancel.is_set()):
                    _settle(s.future, exc=EngineError(f"{self.name}: cancelled after {len(s.token_ids)} tokens"))
                elif s.finish_reason is not None:
                    s.cache = s.next_logits = None
                    p = s.params
                    _settle(s.future, result=Rollout(prompt_ids=s.prompt_ids, token_ids=s.token_ids, logprobs=s.logprobs,
                                                finish_reason=s.finish_reason, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                                                top_logprobs=s.top_logprobs, prompt_logprobs=s.prompt_logprobs))
                else:
                    with self._cv:  # back in the queue and no longer current in one step: never counted twice
                        self._push(s)
                        self._current = None
            finally:
                with self._cv:
                    self._current = None
                if s.on_turn is not None:
                    s.on_turn()

    def generate_sync(self, prompt_ids: list[int], params: SamplingParams, max_tokens: int, seed: int | None,
                      cancel: threading.Event | None = None, request: str | None = None) -> Rollout:
        """Blocking generation through the round-robin scheduler (:meth:`_run`).

        ``cancel`` set (the caller went away or timed out) stops it at its next token, or before its
        next turn; it then raises :class:`EngineError`.
        """
        return self._submit(prompt_ids, params, max_tokens, seed, cancel, request).future.result()

    async def generate(self, prompt_ids, params, max_tokens, seed, request=None) -> Rollout:
        """The sample joins the scheduler's round-robin; when this call is cancelled (client
        disconnect, the bridge's per-sample timeout) the sample is dropped at its next token."""
        cancel = threading.Event()
        s = self._submit(prompt_ids, params, max_tokens, seed, cancel, request)
        try:
            return await asyncio.wrap_future(s.future)
        except asyncio.CancelledError:
            cancel.set()
            raise

    async def generate_stream(self, prompt_ids, params, max_tokens, seed, request=None):
        """The sample of :meth:`generate`, a :class:`~.base.Delta` after each scheduler turn that
        produced tokens (up to ``slice_tokens`` of them); closing the iteration drops the sample
        at its next token, as a cancelled :meth:`generate` does."""
        loop = asyncio.get_running_loop()
        woke = asyncio.Event()
        cancel = threading.Event()

        def wake() -> None:  # from the scheduler thread
            try:
                loop.call_soon_threadsafe(woke.set)
            except RuntimeError:  # the loop is closed: nobody reads any more
                cancel.set()

        s = self._submit(prompt_ids, params, max_tokens, seed, cancel, request, on_turn=wake)
        sent = 0
        first = True
        try:
            while True:
                await woke.wait()
                woke.clear()
                if s.future.done():
                    r = s.future.result()  # raises the sample's error
                    yield Delta(token_ids=r.token_ids[sent:], logprobs=r.logprobs[sent:],
                                top_logprobs=r.top_logprobs[sent:] if r.top_logprobs is not None else None,
                                prompt_logprobs=r.prompt_logprobs if first else None, finish_reason=r.finish_reason)
                    return
                # the scheduler thread appends a token's id, then its logprob, then its alternatives, and may be in
                # its next turn already: the first n complete tokens are stable
                n = min(len(s.token_ids), len(s.logprobs), len(s.top_logprobs) if s.top_logprobs is not None else len(s.logprobs))
                if n > sent:
                    yield Delta(token_ids=s.token_ids[sent:n], logprobs=s.logprobs[sent:n],
                                top_logprobs=s.top_logprobs[sent:n] if s.top_logprobs is not None else None,
                                prompt_logprobs=s.prompt_logprobs if first else None)
                    sent, first = n, False
        finally:
            if not s.future.done():
                cancel.set()

    def score_sync(self, prompt_ids: list[int], token_ids: list[int]) -> list[float]:
        from foursight.trainer_bridge.scoring import teacher_forced_logprobs

        with self._lock, torch.no_grad():
            lp, _ = teacher_forced_logprobs(self.model, [prompt_ids], [token_ids])
        return [float(v) for v in lp[0, : len(token_ids)]]

    async def score(self, prompt_ids: list[int], token_ids: list[int]) -> list[float]:
        return await asyncio.to_thread(self.score_sync, prompt_ids, token_ids)

    def update_weights_sync(self, path: str, version: int) -> dict[str, Any]:
        """Load the BF16 tensors (HF names) of a safetensors file or folder (:meth:`load_tensors_sync`),
        read by the project's one reader (:func:`foursight.tensor_io.iter_safetensors`: each checked finite)."""
        from foursight.schema import CheckpointError
        from foursight.tensor_io import iter_safetensors

        try:
            tensors = dict(iter_safetensors(path))
        except CheckpointError as e:
            raise EngineError(str(e)) from None
        return self.load_tensors_sync(tensors, version)

    def load_tensors_sync(self, tensors: dict[str, Any], version: int) -> dict[str, Any]:
        """The one HF weight sync: copy tensors (HF names) into the model; a FourSight layer's
        ``weight`` is re-quantized with its channel set (``FourSightLinear.set_weight``), an FP8
        rowwise layer's by ``Fp8Linear.set_weight``. All are
        checked (name, shape, finiteness of every floating tensor) before any is applied."""
        from foursight.fp8 import Fp8Linear
        from foursight.hf import FourSightLinear
        from foursight.schema import CheckpointError, check_all_finite

        t0 = time.monotonic()
        modules = dict(self.model.named_modules())
        params = dict(self.model.named_parameters())
        buffers = dict(self.model.named_buffers())
        plan: list[tuple[str, Any, Any]] = []
        for name, t in tensors.items():
            if not t.is_floating_point():  # an int32 tensor would be applied truncated (issue 28)
                raise UpdateRefused(f"tensor {name} has dtype {t.dtype}, expected a floating-point weight")
            prefix, _, leaf = name.rpartition(".")
            mod = modules.get(prefix)
            if isinstance(mod, (FourSightLinear, Fp8Linear)) and leaf == "weight":
                if tuple(t.shape) != (mod.out_features, mod.in_features):
                    raise UpdateRefused(f"tensor {name} has shape {list(t.shape)}, expected {[mod.out_features, mod.in_features]}")
                plan.append(("requant", mod, t))
            elif name in params or name in buffers:
                dst = params.get(name, buffers.get(name))
                if tuple(dst.shape) != tuple(t.shape):
                    raise UpdateRefused(f"tensor {name} has shape {list(t.shape)}, expected {list(dst.shape)}")
                plan.append(("copy", dst, t))
            else:
                raise UpdateRefused(f"tensor {name} does not match any parameter of the model")
        try:  # every tensor finite, with one read to the host (a per-tensor check synchronised a GPU each time)
            check_all_finite(tensors.items())
        except CheckpointError as e:
            raise UpdateRefused(str(e)) from None
        with self._lock, torch.no_grad():
            n_req = 0
            for op, dst, t in plan:
                if op == "requant":
                    dst.set_weight(t.to(torch.bfloat16))
                    n_req += 1
                else:
                    dst.copy_(t.to(dst.dtype))
            self.version = int(version)
        return {"engine": self.name, "version": version, "updated_tensors": len(plan), "requantized_layers": n_req, "seconds": time.monotonic() - t0}

    async def update_weights(self, path: str, version: int) -> dict[str, Any]:
        return await asyncio.to_thread(self.update_weights_sync, path, version)

    async def health(self) -> bool:
        return self.model is not None

    @property
    def vocab_size(self) -> int | None:
        n = getattr(getattr(self.model, "config", None), "vocab_size", None)
        return int(n) if n else None

    async def context_length(self) -> int | None:
        """The model's ``max_position_embeddings`` (its positions end there)."""
        n = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        return int(n) if n else None

    async def served_state(self) -> dict[str, Any] | None:
        return {"boot_id": self.boot_id, "version": self.version} if self.model is not None else None
