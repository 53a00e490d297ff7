"""Verifiable-reward tasks for the RL experiment, generated in code (no data set download).

Each task turns an integer seed into a :class:`Problem` (a chat prompt and the exact expected
answer string) and scores a completion with a strict, checkable rule:

* ``add``   — sum of two 2-digit numbers: ``What is 47 + 38?`` → ``Answer: 85``.
* ``sub``   — difference of two 2-digit numbers (may be negative).
* ``sort``  — four numbers in [0, 99] sorted ascending: ``Answer: 3, 15, 42, 77``.
* ``count`` — occurrences of a letter in a short word list: ``Answer: 4``.
* ``seq`` — the numbers from a to b counting by 1, 2 or 3 (8–12 numbers, all two-digit):
  ``List the numbers from 23 to 37 counting by 2, separated by commas.`` →
  ``Answer: 23, 25, 27, ..., 37`` (about 30–50 tokens); ``seq1`` counts by 1, 6–10 numbers, and says how many
  (``List the 8 numbers from 59 to 66, ...``).
* ``chain3`` / ``chain4`` / ``chain5`` — a running sum: a start in [10, 30], then 2, 3 or 4 terms
  ``+ d`` or ``- d`` with d in [2, 9] (every partial result in [0, 99]), answered with worked
  steps: ``Compute 23 + 8 - 7.`` → ``23 + 8 = 31`` / ``31 - 7 = 24`` / ``Answer: 24``. The worked
  answer runs about 20–60 tokens,
  so a sequence filter has something to look at (the ``add`` answers are 3–8 tokens). Its
  ``Problem.solution`` holds the worked steps (shown by the ``oneshot`` prompt style).

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
    #: worked steps before the answer line (chain tasks; empty for the one-line tasks)
    solution: str = ""

    def messages(self, style: str = "oneshot") -> list[dict[str, str]]:
        """Chat messages (system + user) for the tokenizer's chat template.

        ``style="oneshot"`` appends a solved example of the same task in the exact answer
        format to the user message; ``"plain"`` sends the bare question.
        """
        q = self.question
        if style == "oneshot":
            ex = EXAMPLES[self.task]
            worked = f"{ex.solution}\n" if ex.solution else ""
            q = f"{q}\nReply in the format of this example.\nExample: {ex.question}\n{worked}Answer: {ex.answer}"
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


def _chain(terms: int, lo: int, hi: int, start: tuple[int, int], cap: int):
    def make(rng: random.Random) -> Problem:
        total = rng.randint(*start)
        text, steps = str(total), []
        for _ in range(terms - 1):
            x = rng.randint(lo, hi)
            op = rng.choice("+-")
            if op == "+" and total + x > cap:
                op = "-"
            if op == "-" and total - x < 0:
                op = "+"
            new = total + x if op == "+" else total - x
            steps.append(f"{total} {op} {x} = {new}")
            text += f" {op} {x}"
            total = new
        return Problem(f"chain{terms}", f"Compute {text}. Work it out one operation at a time.", str(total), "\n".join(steps))

    return make


def _seq(steps: tuple[int, ...], lengths: tuple[int, int], name: str, say_count: bool = False):
    def make(rng: random.Random) -> Problem:
        step = rng.choice(steps)
        n = rng.randint(*lengths)
        a = rng.randint(10, 99 - step * (n - 1))
        xs = [a + step * i for i in range(n)]
        by = "" if step == 1 else f" counting by {step}"
        count = f"{n} " if say_count else ""
        return Problem(name, f"List the {count}numbers from {xs[0]} to {xs[-1]}{by}, separated by commas.", ", ".join(map(str, xs)))

    return make


TASKS = {"add": _add, "sub": _sub, "sort": _sort, "count": _count, "chain3": _chain(3, 2, 9, (10, 30), 99), "chain4": _chain(4, 2, 9, (10, 30), 99),
         "chain5": _chain(5, 2, 9, (10, 30), 99), "seq": _seq((1, 2, 3), (8, 12), "seq"), "seq1": _seq((1,), (6, 10), "seq1", say_count=True)}
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
