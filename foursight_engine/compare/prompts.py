"""The prompts of ``foursight compare``: the built-in chat prompts or a JSONL file, chat-templated."""

from __future__ import annotations

from foursight.calibration import read_jsonl
from foursight.compare.spec import CompareError

BUILTIN_PROMPTS = [
    "What is 37 + 48? Answer with the number.",
    "Write a haiku about autumn leaves.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers larger than 50.",
    "Write a Python function that reverses a string.",
    "What is the capital of Australia, and why is it not Sydney?",
    "Translate 'good morning, how are you?' into French.",
    "Give me a short tip for writing clear emails.",
    "Sort these numbers: 42, 7, 19, 3, 88.",
    "What does GPU stand for?",
    "Summarize the plot of Romeo and Juliet in one sentence.",
    "How many legs does a spider have?",
    "Compute 12 times 13 step by step.",
    "Name two benefits of regular exercise.",
    "What is the boiling point of water in Fahrenheit?",
    "Write a SQL query that counts rows in a table named users.",
]


def load_prompts(source: str, n: int, tokenizer) -> list[list[int]]:
    """Chat-templated prompt token ids: ``builtin`` or a JSONL file (``prompt``/``text`` or ``messages`` per line)."""
    if source == "builtin":
        convs = [[{"role": "user", "content": p}] for p in BUILTIN_PROMPTS]
    else:
        convs = []
        try:
            records = list(read_jsonl(source))
        except (ValueError, FileNotFoundError) as e:
            raise CompareError(f"--prompts {e}") from None
        for i, rec in records:
            if isinstance(rec.get("messages"), list):
                convs.append(rec["messages"])
            elif isinstance(rec.get("prompt", rec.get("text")), str):
                convs.append([{"role": "user", "content": rec.get("prompt", rec.get("text"))}])
            else:
                raise CompareError(f"--prompts {source}:{i}: expected 'prompt', 'text' or 'messages'")
    if not convs:
        raise CompareError(f"--prompts {source}: no prompts")
    out = []
    for i in range(n):
        conv = convs[i % len(convs)]
        if tokenizer.chat_template:
            ids = tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = tokenizer("\n".join(m["content"] for m in conv))["input_ids"]
        out.append(list(ids))
    return out
