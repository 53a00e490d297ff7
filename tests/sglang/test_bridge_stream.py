"""The bridge's OpenAI routes over a real SGLang CPU server stream token by token.

The bridge's SGLang engine reads ``/generate`` with ``stream: true``
(``SGLangHTTPEngine.generate_stream``). Through the official ``openai`` client, a streamed
completion comes in one chunk per token or few tokens (before: one chunk holding the whole sample,
at its end), and, joined, its tokens, logprobs and text are those of the same request not streamed
(greedy, so both are the same sample).
"""

from __future__ import annotations

import pytest

from helpers.sglang_engine import running_server

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

TOKENS = 24


@pytest.fixture(scope="module")
def bridge(tiny_ckpt, tmp_path_factory):
    from foursight.trainer_bridge.backends.sglang import SGLangHTTPEngine
    from foursight.trainer_bridge.launch import BridgeThread
    from foursight.trainer_bridge.server import create_app

    with running_server(tiny_ckpt, tmp_path_factory.mktemp("sglang-stream") / "server.log") as url:
        b = BridgeThread(create_app([SGLangHTTPEngine(url, tokenizer=tiny_ckpt)])).start()
        try:
            yield b.url
        finally:
            b.stop()


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_sglang_streams_token_by_token_and_equals_the_whole_answer(bridge, kind):
    import openai

    c = openai.OpenAI(base_url=bridge + "/v1", api_key="x")
    model = c.models.list().data[0].id
    fields = dict(model=model, max_tokens=TOKENS, temperature=0.0, extra_body={"ignore_eos": True, "return_token_ids": True})
    if kind == "completion":
        call, ask = c.completions.create, dict(prompt="The capital of France is", logprobs=0)
    else:
        call, ask = c.chat.completions.create, dict(messages=[{"role": "user", "content": "Hi"}], logprobs=True)
    whole = call(**fields, **ask).choices[0]
    chunks = [ch.choices[0] for ch in call(**fields, **ask, stream=True) if ch.choices]
    with_tokens = [ch for ch in chunks if ch.model_extra.get("token_ids")]
    ids = [t for ch in with_tokens for t in ch.model_extra["token_ids"]]
    assert ids == whole.model_extra["token_ids"] and len(ids) == TOKENS
    assert len(with_tokens) >= TOKENS // 4, f"{len(with_tokens)} chunks with tokens for {TOKENS} tokens: the sample was not streamed"
    if kind == "completion":
        text = "".join(ch.text for ch in chunks)
        assert text == whole.text
        streamed = [v for ch in with_tokens for v in ch.logprobs.token_logprobs]
        expected = whole.logprobs.token_logprobs
    else:
        text = "".join(ch.delta.content or "" for ch in chunks)
        assert text == whole.message.content
        streamed = [x.logprob for ch in with_tokens for x in ch.logprobs.content]
        expected = [x.logprob for x in whole.logprobs.content]
    assert streamed == pytest.approx(expected, abs=1e-3)
    assert chunks[-1].finish_reason == whole.finish_reason == "length"
