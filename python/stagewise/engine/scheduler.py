"""Which requests run in the next step, and their KV blocks.

The engine has ``max_num_seqs`` user rows. A request waits in a FIFO queue until a
row is free and the KV pool holds blocks for its whole prompt; it then runs its
prefill and one decode token per step after that. A step's prefill tokens are at
most ``max_prefill_tokens`` (chunked prefill): a longer prompt is prefilled in
chunks over several steps, prompts already started going first, while the running
rows keep decoding in the same steps; only the chunk that ends a prompt samples a
token. Every step is one :class:`~stagewise.model.batch.StepBatch`: the prefill
chunks first, then the decodes of the running rows.

KV lifecycle, as counted by a :class:`~stagewise.kv.budget.KVBudget` for every layer group of the
model: blocks for the whole prompt when a request joins (a sliding-window group: at most its cap),
one slot per fed token (a block whenever a boundary is crossed), all freed at once when the
request finishes, is cancelled or fails. With prefix caching a request is admitted as a whole
prompt (its reservation counts the cached blocks too, so a hit never runs the pool short), and its
first chunk starts after the tokens found cached; the queue's head waits while a prefill in flight
computes the blocks it would find next (questions about a document that arrive during its first
prefill then compute only their own tokens). Running requests take their decode slot
before new requests are admitted, so a request in flight is never starved by a
newcomer; when the pool is still short, that one request fails with finish_reason
"error" and its blocks go back to the pool for the others. Draft tokens (speculative decoding) get
slots only from what every running request's next token left, and a request's rejected drafts
are taken off its count when its next step is scheduled: the step in which every stage drops their
KV, before it takes any block.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Protocol

from stagewise.kv import OutOfKVBlocks
from stagewise.kv.budget import KVBudget


@dataclass(kw_only=True, slots=True)
class SeqState:
    """What the scheduler tracks of one request: its tokens and where it runs."""

    request_id: Hashable
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    """Generated tokens; the last one is fed back in the next decode step."""
    row: int | None = None
    """User row in [0, max_num_seqs) while running; None while waiting or after it ends."""
    num_prefilled: int = 0
    """Prompt tokens scheduled into steps so far (chunked prefill); the prompt is prefilled when
    this reaches ``len(prompt_ids)``."""
    cached_tokens: int = 0
    """Prompt tokens found in the prefix cache when it was admitted: its first chunk starts there."""
    prefix_blocks: tuple[int, ...] = ()
    """The cached blocks holding them, which its first step shares."""
    drafts: tuple[int, ...] = ()
    """Draft tokens its next decode step verifies (speculative decoding): the step feeds its last
    token and these, and yields 1 to ``len(drafts) + 1`` tokens."""
    proposed: int = 0
    """Draft tokens its steps verified so far."""
    accepted: int = 0
    """Of them, those accepted."""

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError(f"SeqState.prompt_ids: request {self.request_id!r} needs at least one token, got []")

    @property
    def num_cached(self) -> int:
        """Tokens in the KV cache between steps: the prompt and every generated token already fed
        back (all but the last, which the next decode step feeds at position ``num_cached``)."""
        return len(self.prompt_ids) + max(len(self.output_ids) - 1, 0)


@dataclass(kw_only=True, slots=True, frozen=True)
class PrefillChunk:
    """Prompt tokens ``[start, start + length)`` of one request, run in one step."""

    seq: SeqState
    start: int
    length: int

    @property
    def last(self) -> bool:
        """Whether the chunk ends the prompt (its request samples a token after it)."""
        return self.start + self.length == len(self.seq.prompt_ids)

    @property
    def first(self) -> bool:
        """Whether the chunk starts the request (after its cached prefix, if any)."""
        return self.start == self.seq.cached_tokens


@dataclass(kw_only=True, slots=True)
class ScheduledStep:
    """The outcome of :meth:`Scheduler.schedule`."""

    prefills: list[PrefillChunk]
    """Prompt chunks that run this step (KV allocated for the whole prompt)."""
    decodes: list[SeqState]
    """Running requests that feed their last generated token (slot allocated), those that verify
    drafts first (slots for them too)."""
    failed: list[tuple[SeqState, str]]
    """Requests that could not get KV blocks, with the reason; their blocks are already freed."""

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes

    @property
    def seqs(self) -> list[SeqState]:
        """Every request of the step, in row order."""
        return [c.seq for c in self.prefills] + self.decodes

    @property
    def sampled(self) -> list[SeqState]:
        """The requests that sample a token after the step, in row order: those whose prompt
        ends in it, then the decodes."""
        return [c.seq for c in self.prefills if c.last] + self.decodes


@dataclass(kw_only=True, slots=True, frozen=True)
class SchedulerStatus:
    waiting: int
    """Requests in the queue (queue depth)."""
    running: int
    """Active user rows."""
    max_num_seqs: int
    free_blocks: int
    total_blocks: int
    cached_blocks: int = 0
    """Of the free blocks, those whose KV the prefix cache keeps (stage 0's pool)."""
    evicted_blocks: int = 0
    """Cached blocks taken back for new KV since the engine started."""


class PrefixLookup(Protocol):
    """What the scheduler asks the prefix cache (:class:`~stagewise.engine.prefix_cache.PrefixCaching`)."""

    def lookup(self, seq: SeqState) -> int:
        """The prompt tokens of a request being admitted that are cached."""

    def waits(self, seq: SeqState) -> bool:
        """Whether the queue's head should wait for a prefill in flight."""


class Scheduler:
    """FIFO admission into a fixed number of rows, KV blocks counted by one :class:`KVBudget`."""

    def __init__(self, budget: KVBudget, *, max_num_seqs: int, max_model_len: int,
                 max_prefill_tokens: int = 8192, pool_busy_elsewhere: Callable[[], bool] | None = None,
                 prefix: PrefixLookup | None = None, waiting: deque[SeqState] | None = None) -> None:
        """``pool_busy_elsewhere`` tells whether others hold blocks of the same pool (microbatch
        groups of a pipeline): a prompt that does not fit then waits instead of failing.
        ``prefix``: the prefix cache (:mod:`stagewise.engine.prefix_cache`): an admitted request's
        prefill starts after its cached tokens, and the queue's head waits while a prefill in
        flight computes the blocks it would find. ``waiting``: a queue shared with other schedulers
        (microbatch groups), which admit from it too (None: its own)."""
        for name, value in (("max_num_seqs", max_num_seqs), ("max_model_len", max_model_len),
                            ("max_prefill_tokens", max_prefill_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Scheduler: {name} must be an int >= 1, got {value!r}")
        if budget.max_model_len < max_model_len:
            raise ValueError(f"Scheduler: the KV budget holds at most {budget.max_model_len} tokens per request, "
                             f"less than max_model_len={max_model_len}")
        self.budget = budget
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[SeqState] = deque() if waiting is None else waiting
        self.running: dict[Hashable, SeqState] = {}  # in admission order
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        self._busy_elsewhere = pool_busy_elsewhere or (lambda: False)
        self._prefix = prefix

    # ---- requests ------------------------------------------------------------

    def add(self, seq: SeqState) -> None:
        """Queue a request. ValueError (nothing queued) for a known id or a prompt that can
        never run: not shorter than max_model_len or needing more blocks than the whole pool."""
        if seq.request_id in self.running or any(s.request_id == seq.request_id for s in self.waiting):
            raise ValueError(f"Scheduler.add: request id {seq.request_id!r} is already in use")
        n = len(seq.prompt_ids)
        if n >= self.max_model_len:
            raise ValueError(f"prompt of request {seq.request_id!r} has {n} tokens: too long for max_model_len="
                             f"{self.max_model_len} (prompt + generated tokens), which leaves no room to generate")
        never = self.budget.fits_at_all(n)
        if never is not None:
            raise ValueError(f"prompt of request {seq.request_id!r} has {n} tokens and {never}")
        self.waiting.append(seq)

    def finish(self, request_id: Hashable) -> SeqState | None:
        """Remove a finished, cancelled or failed request and free its blocks and row at once.
        Returns its state, or None for an unknown id."""
        for i, seq in enumerate(self.waiting):
            if seq.request_id == request_id:
                del self.waiting[i]
                return seq
        seq = self.running.pop(request_id, None)
        if seq is None:
            return None
        if request_id in self.budget:
            self.budget.free(request_id)
        self._free_rows.append(seq.row)
        seq.row = None
        return seq

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def status(self) -> SchedulerStatus:
        return SchedulerStatus(waiting=len(self.waiting), running=len(self.running), max_num_seqs=self.max_num_seqs,
                               free_blocks=self.budget.num_free_blocks, total_blocks=self.budget.num_blocks)

    # ---- one step ------------------------------------------------------------

    def schedule(self, prefill_budget: int | None = None, new_rows: int | None = None) -> ScheduledStep:
        """Allocate this step's KV: a slot for each running request's fed-back token, then up to
        ``max_prefill_tokens`` prompt tokens: the next chunks of prompts already started, then the
        prompts of queued requests while rows and blocks allow. ``prefill_budget`` and ``new_rows``
        (see :mod:`stagewise.engine.pacing`) lower the prompt tokens and the requests started."""
        step = ScheduledStep(prefills=[], decodes=[], failed=[])
        decoding = [seq for seq in self.running.values() if seq.output_ids]  # (none only after a step that raised)
        for seq in decoding:  # the last step's rejected drafts: every stage drops their KV as this step begins
            if self.budget.num_tokens(seq.request_id) > seq.num_cached:
                self.budget.truncate(seq.request_id, seq.num_cached)
        for seq in decoding:
            rid = seq.request_id
            try:
                self.budget.append(rid, 1)
            except OutOfKVBlocks as err:
                step.failed.append((seq, f"out of KV cache blocks: request {rid!r} at "
                                         f"{seq.num_cached} tokens needs another block ({err})"))
                self.finish(rid)
                continue
            step.decodes.append(seq)
        verifying: list[SeqState] = []
        for seq in step.decodes:  # drafts take what the decodes left
            if seq.drafts:
                try:
                    self.budget.append(seq.request_id, len(seq.drafts))
                    verifying.append(seq)
                except OutOfKVBlocks:
                    seq.drafts = ()  # no room to speculate: decode one token
        if verifying:  # rows that verify drafts run as chunks, before the decodes
            step.decodes = verifying + [s for s in step.decodes if not s.drafts]
        budget = self.max_prefill_tokens if prefill_budget is None else min(prefill_budget, self.max_prefill_tokens)
        for seq in list(self.running.values()):
            if budget > 0 and seq.num_prefilled < len(seq.prompt_ids):
                budget -= self._chunk(step, seq, budget)
        admit = len(self._free_rows) if new_rows is None else min(new_rows, len(self._free_rows))
        while self.waiting and admit > 0 and budget > 0:
            seq = self.waiting[0]
            if self._prefix is not None and self._prefix.waits(seq):
                break  # admitted after the step that computes its next blocks: then it finds them
            n = len(seq.prompt_ids)
            try:
                self.budget.add(seq.request_id, n)
            except OutOfKVBlocks as err:
                if self.running or step.prefills or self._busy_elsewhere():
                    break  # blocks come back when running requests end: wait in the queue
                self.waiting.popleft()
                step.failed.append((seq, f"out of KV cache blocks for the prompt of request "
                                         f"{seq.request_id!r} ({n} tokens): {err}"))
                continue
            self.waiting.popleft()
            admit -= 1
            seq.row = self._free_rows.pop()
            self.running[seq.request_id] = seq
            if self._prefix is not None:
                seq.num_prefilled = self._prefix.lookup(seq)
            budget -= self._chunk(step, seq, budget)
        return step

    @staticmethod
    def _chunk(step: ScheduledStep, seq: SeqState, budget: int) -> int:
        """Schedule the next chunk of ``seq``'s prompt, at most ``budget`` tokens; returns its length."""
        n = min(len(seq.prompt_ids) - seq.num_prefilled, budget)
        step.prefills.append(PrefillChunk(seq=seq, start=seq.num_prefilled, length=n))
        seq.num_prefilled += n
        return n


class GroupedScheduler:
    """``num_groups`` schedulers (the microbatches of a pipeline) over one KV pool and one queue.

    Requests wait in one FIFO queue; the group whose step is being scheduled admits from it, so a
    request never waits behind one group while another could start it. A request stays in the
    group that admitted it. Each group admits at most its fair share, the requests running and
    waiting over the groups (rounded up), less its own running ones: the groups stay about as
    full as each other, so that every stage has a microbatch to work on. Each group is scheduled
    on its own, so up to ``num_groups`` steps can be in flight. The ``max_num_seqs`` rows are
    dealt out to the groups as evenly as possible."""

    def __init__(self, budget: KVBudget, *, num_groups: int, max_num_seqs: int, max_model_len: int,
                 max_prefill_tokens: int = 8192, prefix: PrefixLookup | None = None) -> None:
        if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 1:
            raise ValueError(f"GroupedScheduler: num_groups must be an int >= 1, got {num_groups!r}")
        if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"GroupedScheduler: max_num_seqs must be an int >= 1, got {max_num_seqs!r}")
        num_groups = min(num_groups, max_num_seqs)
        base, extra = divmod(max_num_seqs, num_groups)
        self.budget = budget
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.waiting: deque[SeqState] = deque()
        """The one queue every group admits from."""
        self.groups: list[Scheduler] = []
        for g in range(num_groups):
            self.groups.append(Scheduler(budget, max_num_seqs=base + (g < extra), max_model_len=max_model_len,
                                         max_prefill_tokens=max_prefill_tokens,
                                         pool_busy_elsewhere=lambda g=g: self._busy_besides(g), prefix=prefix,
                                         waiting=self.waiting))

    def _busy_besides(self, group: int) -> bool:
        return any(s.running for i, s in enumerate(self.groups) if i != group)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def add(self, seq: SeqState) -> None:
        if any(seq.request_id in s.running for s in self.groups):
            raise ValueError(f"Scheduler.add: request id {seq.request_id!r} is already in use")
        self.groups[0].add(seq)  # (the shared queue: checked against it there)

    def finish(self, request_id: Hashable) -> SeqState | None:
        group = next((s for s in self.groups if request_id in s.running), self.groups[0])
        return group.finish(request_id)

    def schedule(self, group: int, prefill_budget: int | None = None, new_rows: int | None = None) -> ScheduledStep:
        if len(self.groups) > 1 and self.waiting:
            running = [len(s.running) for s in self.groups]
            fair = -(-(sum(running) + len(self.waiting)) // len(self.groups)) - running[group]
            new_rows = max(fair, 0) if new_rows is None else min(new_rows, max(fair, 0))
        return self.groups[group].schedule(prefill_budget, new_rows)

    def has_work(self, group: int) -> bool:
        return self.groups[group].has_unfinished()

    def has_unfinished(self) -> bool:
        return any(s.has_unfinished() for s in self.groups)

    def status(self) -> SchedulerStatus:
        return SchedulerStatus(waiting=len(self.waiting),
                               running=sum(len(s.running) for s in self.groups), max_num_seqs=self.max_num_seqs,
                               free_blocks=self.budget.num_free_blocks, total_blocks=self.budget.num_blocks)
