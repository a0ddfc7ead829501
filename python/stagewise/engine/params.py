"""What a request asks of sampling, and what it gets back, without torch (the command line checks
them before anything heavy is imported): :class:`SamplingParams`, :class:`SamplingRequest`,
:class:`TokenLogprobs`. The sampler itself is :mod:`stagewise.engine.sampling`."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

_SEED_RANGE = (0, 2**64 - 1)  # what torch.Generator.manual_seed accepts without wrapping


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    """How one request picks its next tokens and when it stops."""

    max_new_tokens: int = 16
    """Most tokens to generate; >= 1."""
    temperature: float = 1.0
    """Logits are divided by this; 0 selects greedy decoding (argmax)."""
    top_k: int = 0
    """Keep the k most likely tokens (ties at the k-th all kept); 0 turns it off."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 turns it off."""
    seed: int | None = None
    """Seeds the request's own generator; None draws from torch's global generator."""
    stop: list[str] = field(default_factory=list)
    """Generation ends before the first occurrence of any of these strings."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Generation ends at any of these tokens (in addition to the model's EOS ids)."""
    ignore_eos: bool = False
    """Keep generating past the model's EOS ids (stop_token_ids and stop strings still apply);
    benchmarks use it so that every row decodes exactly max_new_tokens."""
    repetition_penalty: float = 1.0
    """> 0; 1 turns it off. Logits of prompt and output tokens: divided (positive) or multiplied
    (negative) by it."""
    presence_penalty: float = 0.0
    """In [-2, 2]; subtracted once from the logit of every token the output already holds."""
    frequency_penalty: float = 0.0
    """In [-2, 2]; subtracted from a token's logit as many times as the output holds it."""
    min_p: float = 0.0
    """In [0, 1]; sampling drops tokens less likely than ``min_p`` times the most likely one."""
    logprobs: int | None = None
    """Return each generated token's log-probability and the ``logprobs`` most likely tokens'
    (0 .. 20; None: none). From the model's float32 logits, before penalties and temperature."""

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not _is_number(self.temperature) or not (0.0 <= self.temperature < float("inf")):
            raise ValueError(
                f"SamplingParams.temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}"
            )
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingParams.top_p must be a number in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not _SEED_RANGE[0] <= self.seed <= _SEED_RANGE[1]):
            raise ValueError(f"SamplingParams.seed must be None or an int in [0, 2**64 - 1], got {self.seed!r}")
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"SamplingParams.stop must be a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(
                f"SamplingParams.stop_token_ids must be a list of ints >= 0, got {self.stop_token_ids!r}"
            )
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"SamplingParams.ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not _is_number(self.repetition_penalty) or not (0.0 < self.repetition_penalty < float("inf")):
            raise ValueError(f"SamplingParams.repetition_penalty must be a finite number > 0 (1 = off), "
                             f"got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"SamplingParams.{name} must be a number in [-2, 2] (0 = off), got {value!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"SamplingParams.min_p must be a number in [0, 1] (0 = off), got {self.min_p!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"SamplingParams.logprobs must be None or an int in [0, {MAX_LOGPROBS}], "
                             f"got {self.logprobs!r}")
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        """Whether its tokens so far change its logits (a penalty is on)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


MAX_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class SamplingRequest:
    """What the stage that samples needs of a request when its first step arrives."""

    params: SamplingParams
    prompt_ids: tuple[int, ...] = ()
    """The prompt, when a repetition penalty needs it (else empty)."""

    @classmethod
    def of(cls, params: SamplingParams, prompt_ids: Iterable[int]) -> SamplingRequest:
        return cls(params, tuple(prompt_ids) if params.repetition_penalty != 1.0 else ())


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One generated token's log-probability and the most likely tokens' at its position."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    """(token, log-probability) of the ``logprobs`` most likely tokens, most likely first."""
