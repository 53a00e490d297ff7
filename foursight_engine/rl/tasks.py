"""Verifiable-reward tasks for the RL experiment, generated in code (no data set download).

Each task turns an integer seed into a :class:`Problem` (a chat prompt and the exact expected
answer string) and scores a completion with a strict, checkable rule:

* ``add``   — sum of two 2-digit numbers: ``What is 47 + 38?`` → ``Answer: 85``.
* ``sub``   — difference of two 2-digit numbers (may be negative).
* ``sort``  — four numbers in [0, 99] sorted ascending: ``Answer: 3, 15, 42, 77``.
* ``count`` — occurrences of a letter in a short word list: ``Answer: 4``.

Reward (:func:`reward`): 1.0 when the completion's first ``Answer:`` line holds exactly the
expected answer, ``format_bonus`` (default 0.1) when it has a well-formed ``Answer:`` line
with a wrong value, 0 otherwise. Eval accuracy counts only exact answers.

The training stream (:func:`train_problems`) and the held-out eval set (:func:`eval_set`) use
disjoint seed ranges, and eval problems are also excluded from training by content.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

SYSTEM = "You are a precise assistant. End your reply with one line of the form 'Answer: <answer>'."
_ANSWER_RE = re.compile(r"Answer:\s*([^\n]*)")
_WORDS = ["banana", "apple", "cherry", "letter", "coffee", "pepper", "bottle", "summer", "rabbit",
          "little", "yellow", "google", "mirror", "balloon", "kitten", "puzzle", "address", "success"]
EVAL_SEED_BASE = 10_000_000


class TaskError(ValueError):
    """Unknown task name or bad task argument (the message names it)."""


@dataclass(frozen=True)
class Problem:
    """One task instance.

    Attributes:
        task: task name.
        question: the user message.
        answer: the exact expected answer string (what follows ``Answer:``).
    """

    task: str
    question: str
    answer: str

    def messages(self, style: str = "oneshot") -> list[dict[str, str]]:
        """Chat messages (system + user) for the tokenizer's chat template.

        ``style="oneshot"`` appends a solved example of the same task in the exact answer
        format to the user message; ``"plain"`` sends the bare question.
        """
        q = self.question
        if style == "oneshot":
            ex = EXAMPLES[self.task]
            q = f"{q}\nReply in the format of this example.\nExample: {ex.question}\nAnswer: {ex.answer}"
        elif style != "plain":
            raise TaskError(f"prompt style must be 'oneshot' or 'plain', got {style!r}")
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]


def _add(rng: random.Random) -> Problem:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return Problem("add", f"What is {a} + {b}?", str(a + b))


def _sub(rng: random.Random) -> Problem:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return Problem("sub", f"What is {a} - {b}?", str(a - b))


def _sort(rng: random.Random) -> Problem:
    xs = [rng.randint(0, 99) for _ in range(4)]
    return Problem("sort", f"Sort these numbers from smallest to largest: {', '.join(map(str, xs))}.",
                   ", ".join(map(str, sorted(xs))))


def _count(rng: random.Random) -> Problem:
    w = rng.choice(_WORDS)
    letters = sorted(set(w))
    c = rng.choice(letters)
    return Problem("count", f"How many times does the letter '{c}' appear in the word '{w}'?", str(w.count(c)))


TASKS = {"add": _add, "sub": _sub, "sort": _sort, "count": _count}
#: the solved example shown by the "oneshot" prompt style (seed -1, never a train/eval seed)
EXAMPLES = {name: fn(random.Random(f"{name}:example")) for name, fn in TASKS.items()}


def make_problem(task: str, seed: int) -> Problem:
    """The problem of ``task`` for integer ``seed`` (deterministic)."""
    if task not in TASKS:
        raise TaskError(f"--task: unknown task {task!r}; choose one of {sorted(TASKS)}")
    return TASKS[task](random.Random(f"{task}:{seed}"))


def eval_set(task: str, n: int = 128) -> list[Problem]:
    """The fixed held-out eval set: ``n`` distinct problems from seeds ≥ :data:`EVAL_SEED_BASE`."""
    if n < 1:
        raise TaskError(f"eval set size must be >= 1, got {n}")
    out: list[Problem] = []
    seen: set[str] = set()
    s = EVAL_SEED_BASE
    while len(out) < n:
        p = make_problem(task, s)
        s += 1
        if p.question not in seen or s - EVAL_SEED_BASE > 50 * n:
            seen.add(p.question)
            out.append(p)
    return out


def train_problems(task: str, step: int, n: int, seed: int = 0, exclude: set[str] | None = None) -> list[Problem]:
    """The ``n`` training problems of ``step`` (same for every run with the same ``seed``).

    Problems whose question is in ``exclude`` (the eval set) are skipped.
    """
    out: list[Problem] = []
    i = 0
    while len(out) < n:
        p = make_problem(task, (seed * 1_000_003 + step) * 1_000 + i)
        i += 1
        if exclude is None or p.question not in exclude:
            out.append(p)
    return out


def extract_answer(completion: str) -> str | None:
    """The text after the first ``Answer:`` (stripped, trailing period removed), or None."""
    m = _ANSWER_RE.search(completion)
    if not m:
        return None
    return m.group(1).strip().rstrip(".").strip()


def _normalise(ans: str) -> str:
    return re.sub(r"\s*,\s*", ", ", ans.strip())


def is_correct(completion: str, problem: Problem) -> bool:
    """True when the completion's first ``Answer:`` value equals the expected answer exactly
    (comma spacing normalised)."""
    a = extract_answer(completion)
    return a is not None and _normalise(a) == problem.answer


def reward(completion: str, problem: Problem, format_bonus: float = 0.1) -> float:
    """1.0 for an exact answer; ``format_bonus`` for a well-formed but wrong ``Answer:`` line; else 0."""
    if is_correct(completion, problem):
        return 1.0
    a = extract_answer(completion)
    if a is not None and re.fullmatch(r"-?\d+(, -?\d+)*", _normalise(a)):
        return format_bonus
    return 0.0
