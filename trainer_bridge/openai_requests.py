"""The request bodies of the bridge's OpenAI routes (:mod:`foursight.trainer_bridge.routes.openai`):
``/v1/completions`` (:class:`CompletionRequest`) and ``/v1/chat/completions``
(:class:`ChatCompletionRequest`), with vLLM's field names and defaults, each turned into the bridge's
:class:`~foursight.trainer_bridge.protocol.SamplingParams` and prompts. Unknown fields are refused;
a field vLLM takes is taken (docs/openai.md lists them), and refused only where the engine behind
cannot honour it (``routes.rollouts.admit`` names the engine)."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from foursight.trainer_bridge.protocol import MAX_LOGPROBS, ChatMessage, Prompt, ResponseFormat, SamplingParams


class StreamOptions(BaseModel):
    """OpenAI's ``stream_options``: ``include_usage`` adds a last chunk with the request's token counts."""

    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


#: fields whose ``null`` vLLM reads as "not given" (its request models type them ``X | None``): the
#: bridge drops them before validation, so that ``"temperature": null`` gets the default as in vLLM
_NULL_IS_ABSENT = frozenset({"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
                             "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "stop",
                             "stop_token_ids", "seed", "stream", "stream_options", "user", "logprobs", "top_logprobs", "echo",
                             "best_of", "response_format", "return_token_ids", "return_tokens_as_token_ids"})


class SamplingFields(BaseModel):
    """The sampling fields both routes take (vLLM's names and defaults)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    #: OpenAI's penalties and ``logit_bias`` (keys: token ids as strings), passed to the engine
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    #: structured output, passed to the engine (``{"type": "text"}`` is no constraint)
    response_format: ResponseFormat | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    n: int = Field(1, ge=1, le=128)
    #: OpenAI's ``best_of``: the best ``best_of`` samples' top ``n``. vLLM 0.32 has no best_of (its
    #: server ignores the field), so only ``best_of <= n``, which asks for nothing beyond the ``n``
    #: samples, is taken; more is refused naming the engine
    best_of: int | None = Field(None, ge=1)
    #: ``-1`` is no seed, as vLLM reads it
    seed: int | None = None
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    #: the text leaves special tokens out (vLLM's default) or keeps them (``false``)
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: "StreamOptions | None" = None
    user: str | None = None
    #: vLLM's token-id extensions (what TRL's ``VLLMClient`` sends): every choice also carries
    #: ``prompt_token_ids`` and ``token_ids``, and logprob tokens are spelled ``"token_id:<id>"``
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False

    #: what the routes' error answers call this request's prompt, and its kind (the routes' error answers)
    prompt_field: ClassVar[str]
    kind: ClassVar[str]

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_absent(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (v is None and k in _NULL_IS_ABSENT)}
        return data

    @field_validator("seed")
    @classmethod
    def _seed(cls, v: int | None) -> int | None:
        if v == -1:
            return None  # vLLM's "no seed"
        if v is not None and v < 0:
            raise ValueError(f"{v}: -1 means no seed (as in vLLM); other negative seeds are refused, since sample j of "
                             "prompt i is seeded seed + i*n + j (docs/openai.md)")
        return v

    @field_validator("response_format")
    @classmethod
    def _text_is_none(cls, v: ResponseFormat | None) -> ResponseFormat | None:
        return None if v is not None and v.type == "text" else v

    def prompts(self) -> list[Prompt]:
        raise NotImplementedError

    def budget(self) -> int | None:
        """``max_tokens`` of each sample as asked (completions: vLLM's default 16); None: the rest of the
        context (chat without a ``max_tokens``, as vLLM's default)."""
        return self.max_tokens or 16

    def budget_field(self) -> str:
        """The field that set :meth:`budget` (what an error about it names)."""
        return "max_tokens"

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def alternatives(self) -> int:
        """How many top alternatives per token the answer shows (the engine's ``logprobs``)."""
        return 0

    def echoes(self) -> bool:
        return False

    def sampling(self, max_tokens: int) -> SamplingParams:
        """The bridge's sampling parameters, each sample asking for ``max_tokens`` (:meth:`budget`, or the
        rest of the context when that is None; ``admit(fit_context=True)`` trims it per prompt)."""
        k = self.alternatives()
        return SamplingParams(max_tokens=max_tokens, min_tokens=self.min_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty, stop=self.stops(),
                              stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, seed=self.seed, logprobs=k,
                              prompt_logprobs=k if self.echoes() and self.wants_logprobs() else None,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              logit_bias=self.logit_bias, response_format=self.response_format)

    def wants_logprobs(self) -> bool:
        raise NotImplementedError


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, token ids, or a list of token-id lists.

    ``logprobs`` k (0 to :data:`MAX_LOGPROBS`): each token's logprob in ``token_logprobs`` and, in
    ``top_logprobs``, the token itself and the k most likely ones, as vLLM returns them. ``echo``
    puts the prompt before the completion (and, with ``logprobs``, the prompt's logprobs)."""

    prompt_field: ClassVar[str] = "prompt"
    kind: ClassVar[str] = "completion"

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    @model_validator(mode="after")
    def _nonempty(self) -> "CompletionRequest":
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        return self

    def prompts(self) -> list[Prompt]:
        p = self.prompt
        if isinstance(p, str):
            return [Prompt(text=p)]
        if all(isinstance(x, int) for x in p):
            return [Prompt(token_ids=list(p))]
        return [Prompt(text=x) if isinstance(x, str) else Prompt(token_ids=list(x)) for x in p]

    def prompt_texts(self) -> list[str | None]:
        """Each prompt's text as given (None for token ids: the echo decodes them)."""
        return [x.text for x in self.prompts()]

    def alternatives(self) -> int:
        return self.logprobs or 0

    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    def echoes(self) -> bool:
        return self.echo


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``: one conversation (``messages``; the bridge applies the chat template).

    ``logprobs: true`` returns the sampled tokens' logprobs in ``choices[i].logprobs.content``,
    with ``top_logprobs`` (0 to :data:`MAX_LOGPROBS`) alternatives each."""

    prompt_field: ClassVar[str] = "messages"
    kind: ClassVar[str] = "chat"

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("when using `top_logprobs`, `logprobs` must be set to true")
        return v

    def prompts(self) -> list[Prompt]:
        return [Prompt(messages=self.messages, add_generation_prompt=self.add_generation_prompt)]

    def budget(self) -> int | None:
        """``max_completion_tokens`` when given, else ``max_tokens`` (vLLM's order: the deprecated
        ``max_tokens`` counts only without the other), else None: the rest of the context, as vLLM."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def budget_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def alternatives(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else 0

    def wants_logprobs(self) -> bool:
        return self.logprobs


# ---- errors: OpenAI's shape, vLLM's status codes -------------------------------------------------
