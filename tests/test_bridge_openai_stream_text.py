"""The streamed text of the bridge's OpenAI routes: decoded incrementally, equal to the whole text.

The reference is the tokenizer's own ``decode`` of the whole sequence (what a non-streamed answer
holds), on the packaged SmolLM2's byte-level BPE, which splits accented letters, CJK characters
and emoji across tokens, and on a SentencePiece-style tokenizer built here (Metaspace, byte
fallback), whose ``decode`` strips the leading space of the first token it decodes, so that a
piece decoded without the tokens before it loses its space. Before incremental decoding the route
decoded the whole completion again for every streamed piece: ``test_a_streamed_choice_decodes_each_token_a_bounded_number_of_times``
failed on that code (about n²/2 tokens decoded for n streamed tokens).
"""

from __future__ import annotations

import itertools
import random

import pytest

from foursight.trainer_bridge.backends.base import Delta
from foursight.trainer_bridge.detokenizer import IncrementalDetokenizer
from foursight.trainer_bridge.protocol import Rollout
from foursight.trainer_bridge.openai_requests import ChatCompletionRequest, CompletionRequest
from foursight.trainer_bridge.openai_logprobs import TokenNames
from foursight.trainer_bridge.routes.openai import OpenAIChoice

TEXTS = ["héllo 日本語 😀 naïve — “quote” 🤖🤖 ok", "Ünïcödé: ζ, ж, 한국어, emoji 👩‍👩‍👧 and ½ of ∑.", "plain ascii, then Ü at the end é"]


@pytest.fixture(scope="module")
def smollm2_tok(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def metaspace_tok():
    """A small SentencePiece-style BPE (Metaspace pre-tokenizer, byte fallback; Llama 2's decoder:
    ▁ -> space, bytes fused, the first leading space stripped), trained here on a few lines."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    t.pre_tokenizer = pre_tokenizers.Metaspace()
    t.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    t.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20 + ["hello world, hello there"] * 20,
                          trainers.BpeTrainer(vocab_size=150, special_tokens=["<unk>", "</s>"]))
    spec = json.loads(t.to_str())  # the 256 byte tokens, as ordinary tokens, for what the vocabulary lacks
    vocab = spec["model"]["vocab"]
    vocab.update({f"<0x{i:02X}>": len(vocab) + i for i in range(256)})
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), unk_token="<unk>", eos_token="</s>")


def _sequences(tok, invalid: bool) -> list[list[int]]:
    """Token sequences with characters split across tokens: the texts, one cut inside a character,
    one with a special token inside, and (``invalid``) random byte tokens and pieces of the texts,
    invalid UTF-8 too."""
    seqs = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    inside = next(i for i, t in enumerate(seqs[0]) if tok.decode([t]).endswith("\ufffd"))
    seqs.append(seqs[0][:inside + 1])  # ends inside a character
    seqs.append(seqs[0][:7] + [tok.eos_token_id] + seqs[0][7:])
    if not invalid:
        return seqs
    rng = random.Random(0)
    bytes_tokens = list(itertools.islice((i for i in range(len(tok)) if tok.decode([i]).endswith("\ufffd")), 200))
    assert len(bytes_tokens) > 20, "the tokenizer has no tokens that end inside a character"
    seqs.append([rng.choice(bytes_tokens + seqs[1]) for _ in range(120)])
    return seqs


def _streamed(tok, ids: list[int], sizes: list[int]) -> tuple[str, list[str]]:
    whole = tok.decode(ids, skip_special_tokens=True)
    d = IncrementalDetokenizer(tok)
    out, i = [], 0
    for n in sizes:
        piece = d.push(ids[i:i + n])
        i += n
        out.append(piece)
        so_far = "".join(out)
        assert whole.startswith(so_far), (ids[:i], so_far)
        assert not so_far.endswith("\ufffd")
    out.append(d.finish())
    return "".join(out), out


@pytest.mark.parametrize("which", ["smollm2", "metaspace"])
def test_incremental_text_is_the_whole_decode(which, request):
    """Pushed one token at a time, or in random pieces, the detokenizer gives out the start of the
    whole decode at every step (never a half character), and joined, the whole decode without a
    character still incomplete at the end. Invalid UTF-8 only with the byte-level BPE (a
    byte-fallback decoder turns a whole invalid run into U+FFFD: the detokenizer's docstring)."""
    tok = request.getfixturevalue(f"{which}_tok")
    rng = random.Random(1)
    held = 0
    for ids in _sequences(tok, invalid=which == "smollm2"):
        whole = tok.decode(ids, skip_special_tokens=True).rstrip("\ufffd")
        one_by_one, pieces = _streamed(tok, ids, [1] * len(ids))
        assert one_by_one == whole
        held += "" in pieces[:-1]
        sizes = []
        while sum(sizes) < len(ids):
            sizes.append(rng.randint(1, 5))
        assert _streamed(tok, ids, sizes)[0] == whole
    assert held >= 4, "characters split across tokens were not exercised"


def test_metaspace_pieces_keep_their_spaces(metaspace_tok):
    """Without the lookback a piece decoded alone loses its leading space ("hello world" streamed as
    "helloworld"): the case the lookback is for."""
    ids = metaspace_tok.encode("hello world, the lazy dog", add_special_tokens=False)
    alone = "".join(metaspace_tok.decode([t]) for t in ids)
    assert alone != metaspace_tok.decode(ids)  # the tokenizer really strips them
    assert _streamed(metaspace_tok, ids, [1] * len(ids))[0] == metaspace_tok.decode(ids)


class _Counting:
    """The real tokenizer, counting the tokens its ``decode`` is given."""

    def __init__(self, tok):
        self.tok, self.decoded = tok, 0

    def decode(self, ids, **kw):
        self.decoded += len(ids) if isinstance(ids, list) else 1
        return self.tok.decode(ids, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def _stream_choice(req, tok, ids: list[int], finish_reason: str) -> tuple[list[str], dict]:
    """A sample streamed through the route's choice one token at a time (as vLLM's stream sends it),
    then its last piece; returns the texts of the chunks and the non-streamed choice of the same sample."""
    counting = _Counting(tok)
    ch = OpenAIChoice(req, counting, TokenNames(tok, False), 0, [1, 2, 3], None)
    texts = []
    for t in ids[:-1]:
        c = ch.piece(Delta(token_ids=[t], logprobs=[-0.5]), None)
        texts.append(c["delta"].get("content", "") if req.kind == "chat" else c["text"])
    r = Rollout(prompt_ids=[1, 2, 3], token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason=finish_reason)
    c = ch.piece(ch.rest(r), r)
    texts.append(c["delta"].get("content", "") if req.kind == "chat" else c["text"])
    whole = OpenAIChoice(req, tok, TokenNames(tok, False), 0, [1, 2, 3], None).whole(r)
    return texts, {"whole": whole, "decoded": counting.decoded}


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_streamed_choice_decodes_each_token_a_bounded_number_of_times(kind, smollm2_tok):
    """A 400-token sample streamed token by token: its chunks' texts, joined, are the non-streamed
    choice's text, and the route decoded each token a few times (at most 8 on average; the old route
    decoded the whole completion for every piece, about n/2 = 200 per token)."""
    ids = (smollm2_tok.encode(" ".join(TEXTS), add_special_tokens=False) * 20)[:400]
    fields = {"max_tokens": 400}
    req = CompletionRequest(prompt="x", **fields) if kind == "completion" else ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **fields)
    texts, got = _stream_choice(req, smollm2_tok, ids, "length")
    whole = got["whole"]["text"] if kind == "completion" else got["whole"]["message"]["content"]
    assert "".join(texts) == whole == smollm2_tok.decode(ids, skip_special_tokens=True).rstrip("\ufffd")
    assert sum(bool(t) for t in texts) > len(ids) // 2, "the text did not come as the tokens did"
    per_token = got["decoded"] / len(ids)
    assert per_token <= 8, f"{got['decoded']} tokens decoded for {len(ids)} streamed ({per_token:.1f} per token)"


def test_a_streamed_choice_is_cut_before_its_stop_string_as_the_whole_one(smollm2_tok):
    """A sample that a stop string ended (the engine stops at the token that completes it, whose
    text may run past it): the chunks hold back what may still become the stop string and, joined,
    are the whole choice's text, cut before it; a multi-byte stop string too."""
    for stop, end in [("日本語", "日本語"), ("\n\nEN", "\n\nEND")]:
        head = smollm2_tok.encode("héllo wörld " * 30, add_special_tokens=False)
        tail = smollm2_tok.encode(end, add_special_tokens=False)
        assert not smollm2_tok.decode(tail[:-1]).startswith(stop)  # the last token completes the stop string
        req = CompletionRequest(prompt="x", max_tokens=400, stop=stop)
        texts, got = _stream_choice(req, smollm2_tok, head + tail, "stop")
        assert "".join(texts) == got["whole"]["text"] == smollm2_tok.decode(head)


@pytest.mark.parametrize("which", ["smollm2", "metaspace"])
def test_the_detokenizer_steps_the_tokenizers_decode_stream(which, request):
    """issue 53 item 8: the streaming detokenizer steps the installed ``tokenizers``' ``DecodeStream``
    (one Rust step per token) instead of the hand-written lookback, which called ``decode`` twice per
    token: while the tokens stream in, the HF ``decode`` is not called at all, only once at the end for
    what ``DecodeStream`` still holds; and the text is the one the tests above check (the whole
    decode), also with special tokens kept (``skip_special_tokens=False``)."""
    tok = request.getfixturevalue(f"{which}_tok")
    for skip in (True, False):
        for ids in _sequences(tok, invalid=which == "smollm2"):
            counting = _Counting(tok)
            d = IncrementalDetokenizer(counting, skip_special_tokens=skip)
            assert d.stream is not None  # a fast tokenizer: DecodeStream
            streamed = "".join(d.push([t]) for t in ids)
            assert counting.decoded == 0, f"decode was called for {counting.decoded} tokens while streaming"
            streamed += d.finish()
            assert streamed == tok.decode(ids, skip_special_tokens=skip).rstrip("\ufffd"), (skip, ids[:12])
