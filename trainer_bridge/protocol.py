"""Wire protocol of the rollout bridge (pydantic models shared by server and client).

``POST /v1/rollouts`` takes a :class:`RolloutRequest` and streams one event per line (NDJSON) or
per SSE ``data:`` frame: a :class:`SampleEvent` for each finished sample, an :class:`ErrorEvent`
for each sample that could not be finished, and exactly one final :class:`EndEvent`. A stream
without its end event was cut: the client raises. See docs/bridge.md.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

PROTOCOL_VERSION = 1
#: token ids and seeds travel as int64 to the engines
INT64_MAX = (1 << 63) - 1
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
LogprobsMode = Literal["raw_logprobs", "processed_logprobs"]
#: most top alternatives per token a request may ask for (``logprobs``, ``prompt_logprobs``,
#: ``top_logprobs``): vLLM's default ``--max-logprobs``
MAX_LOGPROBS = 20
#: seconds one write of a response may wait for the client to read (``--write-timeout``): a
#: stream whose client stops reading is dropped after it, which releases its hold on weight updates.
#: Here, not in guards, so that the CLI (and ``foursight rl``) imports without the server stack.
DEFAULT_WRITE_TIMEOUT_S = 30.0
#: per token, ``(token id, logprob)`` pairs: the token itself first, then the most likely ones
TopLogprobs = list[tuple[int, float]]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    """One part of a message's content in OpenAI's list form (``[{"type": "text", "text": ...}]``).
    Only text parts: the bridge's engines take text prompts, so an image or audio part is refused
    (400 naming the part) instead of dropped."""

    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    """One chat message. ``content`` is a string, a list of text parts (joined with newlines, as
    vLLM joins them for a chat template that takes a string) or null (an assistant turn with no
    text, e.g. one that only called tools; read as the empty string, as vLLM reads it)."""

    role: str = Field(min_length=1)
    content: str | list[TextPart] | None

    def text(self) -> str:
        """The content as the one string the chat template gets (vLLM's rendering of the same message)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)

    def template_dict(self) -> dict[str, str]:
        """The message as the chat template takes it: ``{"role", "content"}`` with the content as one string."""
        return {"role": self.role, "content": self.text()}


class Prompt(_Strict):
    """One prompt: exactly one of ``token_ids``, ``text`` or ``messages`` (chat, template applied by the bridge).

    ``max_tokens`` optionally overrides the request's ``sampling.max_tokens`` for this prompt.
    """

    token_ids: list[TokenId] | None = None
    text: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    max_tokens: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _exactly_one(self) -> "Prompt":
        given = [k for k in ("token_ids", "text", "messages") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of token_ids, text, messages (got {given or 'none'})")
        if self.token_ids is not None:
            if not self.token_ids:
                raise ValueError("token_ids must not be empty")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        if self.text is not None and not self.text:
            raise ValueError("text must not be empty")
        return self


class ResponseFormat(_Strict):
    """OpenAI's and vLLM's ``response_format``: ``json_object`` (the completion is a JSON object) or
    ``json_schema`` (JSON matching ``json_schema["schema"]``), enforced by the engine's structured
    decoding (vLLM's ``response_format``, SGLang's ``json_schema``). ``text`` (no constraint) is
    what no ``response_format`` means; the OpenAI routes pass it on as none."""

    type: Literal["text", "json_object", "json_schema"]
    #: OpenAI's ``{"name", "schema", "strict", "description"}``; ``schema`` is the JSON schema
    json_schema: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema":
            if self.json_schema is None:
                raise ValueError("when response_format type is 'json_schema', the 'json_schema' field must be provided")
            if not isinstance(self.json_schema.get("schema"), dict):
                raise ValueError("response_format.json_schema.schema must be a JSON schema object")
        return self


#: the largest |bias| of ``logit_bias``; larger ones are clamped to it, as vLLM clamps them
MAX_LOGIT_BIAS = 100.0


class SamplingParams(_Strict):
    """Sampling parameters, applied to every sample of a request (vLLM/SGLang semantics).

    ``temperature=0`` is greedy. ``top_k`` of 0 or -1 disables top-k. With ``seed`` set, sample
    ``j`` of prompt ``i`` uses seed ``seed + i * n + j`` so that samples differ yet are reproducible.
    ``presence_penalty``, ``frequency_penalty``, ``logit_bias`` and ``response_format`` are passed
    to the engines that take them (vLLM, SGLang: ``Engine.sampling_extras``); an engine that cannot
    honour one is refused, naming the field and the engine, before any sample starts.
    """

    max_tokens: int = Field(64, ge=1, le=1 << 20)
    min_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    #: stop strings: a sample ends with the token that completes one (vLLM semantics: the returned
    #: tokens include it; the OpenAI routes cut the text before it)
    stop: list[str] = Field(default_factory=list, max_length=16)
    #: vLLM's min-p and repetition penalty (logits processors: ``raw_logprobs`` stay unprocessed)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    ignore_eos: bool = False
    seed: int | None = Field(None, ge=0, le=INT64_MAX)
    #: vLLM's ``logprobs``: also return each sampled token's ``logprobs`` most likely alternatives
    #: (``Rollout.top_logprobs``); 0 returns the sampled token's logprob only
    logprobs: int = Field(0, ge=0, le=MAX_LOGPROBS)
    #: vLLM's ``prompt_logprobs``: also return the prompt's logprobs with this many alternatives
    #: (``Rollout.prompt_logprobs``); None returns none
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    #: OpenAI's penalties on tokens already in the completion (vLLM/SGLang semantics): ``presence``
    #: once per token that occurred, ``frequency`` per occurrence
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    #: token id -> a bias added to its logit before sampling; clamped to ±100, as vLLM clamps it
    logit_bias: dict[TokenId, float] | None = None
    #: structured output (:class:`ResponseFormat`)
    response_format: ResponseFormat | None = None

    @field_validator("logit_bias")
    @classmethod
    def _clamp_bias(cls, v: dict[int, float] | None) -> dict[int, float] | None:
        if v is None:
            return None
        if any(not math.isfinite(b) for b in v.values()):
            raise ValueError("logit_bias values must be finite numbers")
        return {t: min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, float(b))) for t, b in v.items()}

    def extras(self) -> list[str]:
        """The fields set here that only some engines honour (``Engine.sampling_extras``)."""
        out = []
        if self.presence_penalty:
            out.append("presence_penalty")
        if self.frequency_penalty:
            out.append("frequency_penalty")
        if self.logit_bias:
            out.append("logit_bias")
        if self.response_format is not None and self.response_format.type != "text":
            out.append("response_format")
        return out

    @field_validator("min_tokens")
    @classmethod
    def _min_le_max(cls, v: int, info: ValidationInfo) -> int:
        mt = info.data.get("max_tokens")
        if mt is not None and v > mt:
            raise ValueError(f"min_tokens {v} is greater than max_tokens {mt}")
        return v

    @field_validator("stop")
    @classmethod
    def _nonempty_stops(cls, v: list[str]) -> list[str]:
        if any(not s for s in v):
            raise ValueError("stop strings must not be empty")
        return v


class RolloutRequest(_Strict):
    """Body of ``POST /v1/rollouts``."""

    prompts: list[Prompt] = Field(min_length=1, max_length=65536)
    n: int = Field(1, ge=1, le=1024)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    stream_format: Literal["ndjson", "sse"] = "ndjson"
    #: echoed in every event and the X-Request-Id header: printable ASCII only
    request_id: str | None = Field(None, min_length=1, max_length=200, pattern=r"^[\x20-\x7e]+$")
    #: per-sample deadline in seconds (engine call); None uses the server's default
    timeout_s: float | None = Field(None, gt=0)


class Timing(_Strict):
    """Per-sample timing in seconds, measured by the bridge (monotonic clock)."""

    queued_s: float  # request accepted -> engine call started
    engine_s: float  # engine call duration
    total_s: float  # request accepted -> sample event emitted


class Rollout(_Strict):
    """One sampled completion: the rollout record of every FourSight road (the bridge stream and
    :class:`~foursight.trainer_bridge.client.RolloutClient`, the engine backends, ``foursight
    compare`` and ``foursight rl``).

    ``logprobs[t]`` is the engine's log-probability of ``token_ids[t]`` in the engine's
    ``logprobs_mode`` (``raw_logprobs``: log-softmax of the unprocessed logits, no temperature,
    no top-p/top-k; ``processed_logprobs``: after temperature and truncation). The bridge fields
    (``request_id``, ``prompt_index``, ``sample_index``, ``engine``, ``weight_version``,
    ``timing``) are set by the bridge; a backend called directly leaves them at their defaults.
    ``top_logprobs`` (asked for with ``SamplingParams.logprobs`` > 0) and ``prompt_logprobs``
    (``SamplingParams.prompt_logprobs``) hold, per token, ``(token id, logprob)`` pairs in the
    engine's order: the token itself first, then the most likely ones; ``prompt_logprobs[0]`` is
    None (the first prompt token has no context).
    """

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str = "length"
    logprobs_mode: LogprobsMode = "raw_logprobs"
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    engine: str = ""
    weight_version: int = 0
    request_id: str = ""
    prompt_index: int = 0
    sample_index: int = 0
    timing: Timing | None = None
    top_logprobs: list[TopLogprobs] | None = None
    prompt_logprobs: list[TopLogprobs | None] | None = None


class SampleEvent(Rollout):
    """A finished sample on the wire: a :class:`Rollout` whose bridge fields are all given."""

    type: Literal["sample"] = "sample"
    finish_reason: str
    engine: str
    weight_version: int
    request_id: str
    prompt_index: int
    sample_index: int


class ErrorEvent(_Strict):
    """A sample that did not finish (engine died, timed out, or rejected it)."""

    type: Literal["error"] = "error"
    request_id: str
    prompt_index: int
    sample_index: int
    error: str
    engine: str
    weight_version: int


class EndEvent(_Strict):
    """The last event of every stream. ``status`` is "ok" only when every sample finished."""

    type: Literal["end"] = "end"
    request_id: str
    status: Literal["ok", "error"]
    num_samples: int
    num_errors: int
    weight_version: int
    elapsed_s: float


Event = Union[SampleEvent, ErrorEvent, EndEvent]


def parse_event(data: dict[str, Any]) -> Event:
    """Turn one decoded event dict into its model (raises ``ValueError`` on an unknown type)."""
    kind = data.get("type")
    if kind == "sample":
        return SampleEvent.model_validate(data)
    if kind == "error":
        return ErrorEvent.model_validate(data)
    if kind == "end":
        return EndEvent.model_validate(data)
    raise ValueError(f"unknown event type {kind!r}")


def shm_path(name: str) -> str:
    """Path of a shared-memory weights file (``/dev/shm/<name>``, or under ``$FOURSIGHT_SHM_DIR``): where
    a :class:`WeightUpdateRequest`'s ``shm_name`` points."""
    base = os.environ.get("FOURSIGHT_SHM_DIR", "/dev/shm")
    return str(Path(base) / name)


class WeightUpdateRequest(_Strict):
    """Body of ``POST /v1/weights``: new BF16 weights (HF tensor names) and their version.

    Exactly one of ``path`` (a safetensors file or a folder of them, readable by the engine) or
    ``shm_name`` (a safetensors file in ``/dev/shm``, e.g. written by the trainer) is given.
    ``version`` must be greater than the current version.
    """

    path: str | None = None
    shm_name: str | None = Field(None, pattern=r"^[A-Za-z0-9_.\-]+$")
    version: int = Field(ge=0)
    #: seconds to wait for in-flight streams to finish before the update is refused (409)
    drain_timeout_s: float = Field(600.0, gt=0)

    @model_validator(mode="after")
    def _one_source(self) -> "WeightUpdateRequest":
        if (self.path is None) == (self.shm_name is None):
            raise ValueError("give exactly one of path, shm_name")
        return self


class WeightUpdateResponse(_Strict):
    version: int
    previous_version: int
    engines: list[dict[str, Any]]
    elapsed_s: float
