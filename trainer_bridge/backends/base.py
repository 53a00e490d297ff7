"""What every engine backend is: the :class:`Engine` interface, :class:`EngineError`, and the local tokenizer.

An engine backend

* **generates**: one (prompt token ids, sampling params) -> one :class:`~foursight.trainer_bridge.protocol.Rollout`
  with the log-prob of every sampled token (and, when ``params.logprobs`` / ``params.prompt_logprobs``
  ask for them, the top alternatives of each sampled token and the prompt's logprobs);
* **streams** the same sample as :class:`Delta` pieces while the engine produces them
  (:meth:`Engine.generate_stream`; an engine that cannot stream gives one piece at the end);
* **scores**: teacher-forces given completion tokens after a prompt and returns their log-probs;
* reports its health and what it serves, and applies a versioned BF16 weight update.

The backends: :mod:`.vllm` and :mod:`.sglang` (servers over HTTP, sharing :mod:`.http`), :mod:`.hf`
(a Hugging Face model in this process, and ``foursight rl``'s HF rollout copy) and
:mod:`.vllm_inprocess` (``foursight rl``'s in-process vLLM); :mod:`.registry` maps each engine kind
to them. ``foursight rl``'s rollout engines are a :class:`RolloutEngine` (synchronous, batched, made
from a :class:`RolloutSetup`), not an :class:`Engine`. The bridge (server.py),
``foursight compare`` and ``foursight rl`` use them. The bridge owns scheduling, version tagging and
error events; backends only raise :class:`EngineError` (or let httpx/asyncio errors through, which
the bridge reports the same way).
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Protocol, Sequence, runtime_checkable

from foursight.trainer_bridge.protocol import Prompt, Rollout, SamplingParams


class EngineError(RuntimeError):
    """An engine refused or failed a call; the message says which engine and why."""


class UpdateRefused(EngineError):
    """The engine checked a weight update and refused it before applying any of it: the update is at
    fault, not the engine, and the engine still serves its previous weights (the bridge answers 422)."""


@dataclass
class Delta:
    """A piece of one sample as the engine streams it: the tokens produced since the last piece,
    their logprobs (the engine's ``logprobs_mode``), and, when asked for, each token's top
    alternatives (``top_logprobs[t]``: ``(token id, logprob)`` pairs in the engine's order, the
    sampled token first, then the ``params.logprobs`` most likely ones) and, in the first piece
    only, the prompt's logprobs (``prompt_logprobs[0]`` is None, then one such list per prompt
    token, its own token first). ``finish_reason`` is set on the last piece only."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[list[tuple[int, float]] | None] | None = None
    finish_reason: str | None = None


def rollout_of(prompt_ids: list[int], pieces: list[Delta], params: SamplingParams, logprobs_mode: str) -> Rollout:
    """The :class:`Rollout` of a sample streamed as ``pieces`` (all of them, the last one finished)."""
    want_top = params.logprobs > 0
    top = [x for d in pieces for x in (d.top_logprobs or [])] if want_top else None
    prompt = next((d.prompt_logprobs for d in pieces if d.prompt_logprobs is not None), None)
    return Rollout(prompt_ids=list(prompt_ids), token_ids=[t for d in pieces for t in d.token_ids],
                   logprobs=[v for d in pieces for v in d.logprobs], finish_reason=pieces[-1].finish_reason or "unknown",
                   logprobs_mode=logprobs_mode, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                   top_logprobs=top, prompt_logprobs=prompt)


class LocalTokenizer:
    """Prompt -> token ids with a local HF tokenizer (chat template applied for ``messages``)."""

    def __init__(self, path: str | Path):
        from transformers import AutoTokenizer

        self.path = str(path)
        self.tok = AutoTokenizer.from_pretrained(self.path)
        self._lock = threading.Lock()  # HF fast tokenizers are not safe across threads

    @functools.cached_property
    def eos_ids(self) -> frozenset[int]:
        """The ids a sample stops at by itself: the tokenizer's EOS and the ``eos_token_id`` of the
        folder's ``generation_config.json`` (what vLLM stops at). The OpenAI routes leave such a
        final token out of the text, as vLLM does."""
        ids = {int(self.tok.eos_token_id)} if self.tok.eos_token_id is not None else set()
        try:
            e = json.loads((Path(self.path) / "generation_config.json").read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            e = None
        ids.update([e] if isinstance(e, int) else [x for x in e if isinstance(x, int)] if isinstance(e, list) else [])
        return frozenset(ids)

    def encode(self, prompt: Prompt) -> list[int]:
        with self._lock:
            if prompt.token_ids is not None:
                return list(prompt.token_ids)
            if prompt.text is not None:
                return list(self.tok.encode(prompt.text, add_special_tokens=True))
            msgs = [m.template_dict() for m in prompt.messages or []]
            out = self.tok.apply_chat_template(msgs, add_generation_prompt=prompt.add_generation_prompt, tokenize=True)
            if isinstance(out, dict) or hasattr(out, "keys"):
                out = out["input_ids"]
            return [int(t) for t in out]


class Engine(ABC):
    """Abstract backend. ``name`` identifies the engine instance in events and metrics."""

    kind: str = "engine"
    name: str = "engine"
    #: what the engine's per-token logprobs are (see protocol.Rollout)
    logprobs_mode: str = "raw_logprobs"
    tokenizer: LocalTokenizer | None = None
    #: True when a failed ``update_weights`` leaves the previous weights untouched (checked before applied)
    atomic_updates: bool = False
    #: the engine returns top alternatives (``params.logprobs`` > 0) and prompt logprobs
    #: (``params.prompt_logprobs``); the bridge refuses them (400 naming the field) for one that does not
    returns_top_logprobs: bool = False
    #: the sampling fields of :meth:`SamplingParams.extras` this engine honours (vLLM and SGLang take
    #: them all); the bridge refuses the others (naming the field and the engine) before any sample
    sampling_extras: frozenset[str] = frozenset()

    def startup_warnings(self) -> list[str]:
        """What the operator should hear before this engine serves (``bridge serve`` prints each line once)."""
        return []

    def served_model(self) -> str:
        """The model name the engine serves, as its clients name it (``model`` of OpenAI requests,
        ``GET /v1/models``); the engine's ``name`` unless the backend knows better."""
        return self.name

    @property
    def vocab_size(self) -> int | None:
        """Size of the served model's vocabulary (token ids must be below it), None when unknown."""
        return None

    async def context_length(self) -> int | None:
        """The served model's context in tokens (a prompt plus its ``max_tokens`` must fit;
        ``guards.engine_field_errors``), None when unknown."""
        return None

    async def start(self) -> None:
        """Connect / load. Called once by the server at startup."""

    async def aclose(self) -> None:
        """Release connections."""

    async def tokenize(self, prompt: Prompt) -> list[int]:
        """Prompt -> token ids (local tokenizer by default)."""
        if prompt.token_ids is not None:
            return list(prompt.token_ids)
        if self.tokenizer is None:
            raise EngineError(f"{self.name}: text/chat prompts need a tokenizer (pass --tokenizer or --model)")
        return await asyncio.to_thread(self.tokenizer.encode, prompt)

    @abstractmethod
    async def generate(self, prompt_ids: list[int], params: SamplingParams, max_tokens: int, seed: int | None,
                       request: str | None = None) -> Rollout:
        """Sample one continuation of ``prompt_ids`` with the sampled tokens' logprobs (the
        :class:`Rollout`'s bridge fields left at their defaults). ``request`` names the bridge
        request the sample belongs to: an engine that schedules in this process (the HF engine)
        shares its time between requests by it; engine servers schedule themselves and ignore it."""

    async def generate_stream(self, prompt_ids: list[int], params: SamplingParams, max_tokens: int, seed: int | None,
                              request: str | None = None) -> AsyncIterator[Delta]:
        """The sample of :meth:`generate` as :class:`Delta` pieces while the engine produces them.
        This default, for engines that cannot stream, gives the whole sample as one piece when it
        is finished; the HTTP engines (:mod:`.http`) and the HF engine stream token by token.
        Cancelling the iteration (closing it) cancels the sample in the engine."""
        r = await self.generate(prompt_ids, params, max_tokens, seed, request=request)
        yield Delta(token_ids=list(r.token_ids), logprobs=list(r.logprobs), top_logprobs=r.top_logprobs,
                    prompt_logprobs=r.prompt_logprobs, finish_reason=r.finish_reason)

    async def score(self, prompt_ids: list[int], token_ids: list[int]) -> list[float]:
        """Teacher-forced log-probs (raw: log-softmax of the logits) of ``token_ids`` after ``prompt_ids``."""
        raise EngineError(f"{self.name}: this engine does not score teacher-forced")

    @abstractmethod
    async def update_weights(self, path: str, version: int) -> dict[str, Any]:
        """Load new BF16 weights (HF names, safetensors ``path``), re-quantize, return an ack dict with ``version``."""

    @abstractmethod
    async def health(self) -> bool:
        """True when the engine answers."""

    async def broadcast_workers(self) -> int | None:
        """How many ranks this engine's workers take in a trainer's broadcast group (TRL's NCCL road:
        :mod:`foursight.quant_methods.weight_broadcast`), or None when it cannot join one (the bridge then
        keeps its 422 for TRL's NCCL ``init_info``). None by default."""
        return None

    async def broadcast_init(self, init_info: dict[str, Any]) -> dict[str, Any]:
        """Join the trainer's group (``init_info`` as TRL sends it, ``rank_offset`` set for this engine's first worker);
        returns when every rank joined. The ``broadcast_*`` calls raise :class:`UpdateRefused` for an update the engine
        refused before loading any of it."""
        raise EngineError(f"{self.name}: this engine takes no broadcast group")

    async def broadcast_start(self) -> None:
        """Start one update over the group."""
        raise EngineError(f"{self.name}: this engine takes no broadcast group")

    async def broadcast_receive(self, update_info: dict[str, Any]) -> dict[str, Any]:
        """Receive the tensors ``update_info`` announces (``names``, ``dtype_names``, ``shapes``), check and hold them."""
        raise EngineError(f"{self.name}: this engine takes no broadcast group")

    async def broadcast_finish(self, version: int) -> dict[str, Any]:
        """Apply what the update received (re-quantizing) as weight version ``version``; an ack like :meth:`update_weights`'."""
        raise EngineError(f"{self.name}: this engine takes no broadcast group")

    async def broadcast_close(self) -> None:
        """Leave the group."""

    async def check_updatable(self) -> None:
        """Raise :class:`EngineError` naming what is missing (a server flag, the weights token) when this bridge
        could never apply a weight update to the engine; ``bridge serve`` calls it at start and refuses such an
        engine. Nothing to check by default."""

    async def served_state(self) -> dict[str, Any] | None:
        """What the engine itself reports it serves: ``{"boot_id": str, "version": int}`` (the boot
        id changes when the engine process restarts; the version is the one of its last weight
        update, 0 after a fresh start), or None when this engine cannot report it (then the bridge
        cannot detect a restart). Raises when the engine does not answer."""
        return None


@dataclass
class RolloutSetup:
    """What ``foursight rl`` hands a rollout engine's ``for_rl``; each engine takes the part it uses."""

    learner: Any  # the learner (torch.nn.Module, FP32 master weights)
    model_dir: Path  # the model folder the learner was loaded from
    tok: Any  # its tokenizer
    precision: str  # the rollout precision (foursight.precisions)
    channels: dict[str, Any] | None  # the BF16 channel sets calibrated on the initial learner (engines that copy it)
    channels_spec: str  # --channels (engines that quantize the model folder themselves)
    ignore: tuple[str, ...] = ("lm_head",)  # layers kept in BF16 (lm_head and the --bf16-layers carve-out)
    sync: str = "inproc"  # weight sync of the HF rollout: inproc | file
    seed: int = 0


@runtime_checkable
class RolloutEngine(Protocol):
    """``foursight rl``'s rollout engine (:class:`~.hf_rollout.HFRollout`, :class:`~.vllm_inprocess.VLLMRollout`): it
    takes the learner's weights every step and samples groups of completions with the sampled tokens' logprobs."""

    precision: str
    #: the weight version of the last :meth:`sync` (0 before the first)
    version: int
    last_update: dict[str, Any]
    #: the quantized copy of the learner in this process, or None where the engine holds none
    model: Any

    @classmethod
    def for_rl(cls, setup: RolloutSetup) -> "RolloutEngine":
        """The engine for one ``foursight rl`` run."""
        ...

    def sync(self, learner: Any, version: int) -> dict[str, Any]:
        """Push the learner's weights in (re-quantizing); the sync's info (``sync_s``, ``requantized_layers``, ...)."""
        ...

    def generate(self, prompts: Sequence[Sequence[int]], n: int, max_new_tokens: int, seed: int) -> list[Rollout]:
        """``n`` samples per prompt at temperature 1, grouped contiguously, with raw logprobs."""
        ...

    def close(self) -> None:
        """Release the engine (and what it wrote)."""
        ...
