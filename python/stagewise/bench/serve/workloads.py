"""The requests of `stagewise bench serve`, by workload, generated here from a seed:

- ``sharegpt``: independent requests whose prompt and output lengths follow a ShareGPT-like
  (log-normal) distribution; nothing shared but chance.
- ``system-prompt``: one long system prompt (1,024 tokens) before every request's short question.
- ``multi-turn``: conversations of 4 turns; each turn resends the whole conversation (the earlier
  questions and the server's own answers) with a new question.
- ``documents``: 8 questions about each of several 2,000-token documents, the questions of all
  documents arriving mixed.

Requests (a conversation's first turn) arrive at Poisson times; a conversation's later turns go
out as soon as the answer before them has ended. Prompts are words of a small vocabulary until the
model's tokenizer counts the length wanted.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

WORDS = ("time river stone light city north quiet green seven over under bright market song letter garden "
         "winter summer mountain window paper silver engine orange forest morning story number").split()


@dataclass(frozen=True, slots=True)
class Shape:
    """Log-normal lengths, clipped: ``median * exp(sigma * N(0, 1))`` within ``[lo, hi]``."""

    median: float
    sigma: float
    lo: int
    hi: int

    def draw(self, rng: random.Random) -> int:
        return int(min(self.hi, max(self.lo, round(self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0))))))


PROMPT = Shape(96, 0.7, 16, 512)
OUTPUT = Shape(48, 0.7, 8, 192)
"""ShareGPT's lengths (a few hundred prompt tokens, a few hundred answer tokens) scaled down to what
a 2-core CPU answers in seconds."""


@dataclass(frozen=True, slots=True)
class Sizes:
    """Token counts of the shared-prefix workloads (``tiny``: toy sizes that only check the suite)."""

    system: int = 1024
    document: int = 2000
    question: Shape = Shape(24, 0.3, 8, 48)
    answer: Shape = Shape(32, 0.3, 16, 64)
    turns: int = 4
    questions_per_document: int = 8


TINY = Sizes(system=48, document=64, question=Shape(6, 0.3, 3, 10), answer=Shape(4, 0.3, 2, 8), turns=2,
             questions_per_document=2)
WORKLOADS = ("sharegpt", "system-prompt", "multi-turn", "documents")


@dataclass(frozen=True, slots=True)
class Request:
    arrival_s: float
    """Seconds after the run's start."""
    prompt: str
    prompt_tokens: int
    max_tokens: int
    turns: tuple[str, ...] = ()
    """Multi-turn: the questions that follow, each sent with the conversation so far (this prompt,
    the answers and the questions before it) once the answer before it has ended."""


def text(rng: random.Random, tokenize, want: int) -> tuple[str, int]:
    """Words until ``tokenize`` counts at least ``want`` tokens; the text and its count."""
    words: list[str] = []
    while True:
        words += [rng.choice(WORDS) for _ in range(max(1, (want - tokenize(" ".join(words))) // 2))]
        n = tokenize(" ".join(words))
        if n >= want:
            return " ".join(words), n


def workload(kind: str, n: int, rate: float, tokenize, seed: int = 0, prompt: Shape = PROMPT,
             output: Shape = OUTPUT, sizes: Sizes = Sizes()) -> list[Request]:
    """``n`` requests (turns, for ``multi-turn``) of workload ``kind``, arriving at ``rate`` per
    second (exponential gaps)."""
    if kind not in WORKLOADS:
        raise ValueError(f"bench serve: --workload takes one of {', '.join(WORKLOADS)}, got {kind!r}")
    rng, clock = random.Random(seed), [0.0]

    def arrive() -> float:
        clock[0] += rng.expovariate(rate)
        return clock[0]

    if kind == "sharegpt":
        return [Request(arrive(), *text(rng, tokenize, prompt.draw(rng)), output.draw(rng)) for _ in range(n)]
    if kind == "system-prompt":
        system, _ = text(rng, tokenize, sizes.system)
        return [Request(arrive(), *text_after(system, rng, tokenize, sizes.question.draw(rng)), sizes.answer.draw(rng))
                for _ in range(n)]
    if kind == "documents":
        docs = [text(rng, tokenize, sizes.document)[0] for _ in range(-(-n // sizes.questions_per_document))]
        order = [d for d in range(len(docs)) for _ in range(sizes.questions_per_document)][:n]
        rng.shuffle(order)
        return [Request(arrive(), *text_after(docs[d], rng, tokenize, sizes.question.draw(rng)),
                        sizes.answer.draw(rng)) for d in order]
    out = []  # multi-turn: n turns in conversations of sizes.turns
    for first in range(0, n, sizes.turns):
        k = min(sizes.turns, n - first)
        out.append(Request(arrive(), *text(rng, tokenize, sizes.question.draw(rng) * 2), sizes.answer.draw(rng),
                           turns=tuple(text(rng, tokenize, sizes.question.draw(rng))[0] for _ in range(k - 1))))
    return out


def text_after(prefix: str, rng: random.Random, tokenize, want: int) -> tuple[str, int]:
    """``prefix``, a blank line, and a question of about ``want`` tokens; the prompt and its count."""
    question, _ = text(rng, tokenize, want)
    prompt = f"{prefix}\n\n{question}"
    return prompt, tokenize(prompt)


def num_requests(requests: list[Request]) -> int:
    """Requests sent, a conversation's every turn counted."""
    return sum(1 + len(r.turns) for r in requests)
