"""The control messages between the driver and the stage processes, typed, with one encoder.

Start-up: a stage that loaded its layers says :class:`Ready` (how many KV blocks it can hold);
the driver answers every stage with :class:`Setup` (the block count they all use, the next
stage's address, the transport); each stage reports :class:`Connected` once its links are open.
In a stage of several ranks every rank is a process with its own control link: each says
Ready, gets Setup (the leader also the addresses of the others) and reports Connected.
Serving: the driver sends :class:`Add`, :class:`Cancel` and :class:`ResetPrefixCache` to stage 0, which answers with
:class:`Events` (each new token, finished requests) and :class:`Status`; every stage
sends a :class:`Heartbeat` twice a second, :class:`Stats` when asked (:class:`GetStats`) and
:class:`Fatal` before it dies of an error. :class:`Shutdown` stops a stage.

On the wire a message is a CONTROL frame whose JSON object is ``{"op": ..., **fields}``;
:func:`from_frame` checks every field's type and raises :class:`ProtocolError` naming it.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from dataclasses import dataclass, field

from stagewise.engine.images import ImageInputs
from stagewise.engine.requests import FINISH_REASONS
from stagewise.engine.params import SamplingParams, TokenLogprobs
from stagewise.pipeline.protocol import ProtocolError
from stagewise.transport.frame import Frame, StepKind


class Op(str, enum.Enum):
    READY = "ready"
    SETUP = "setup"
    CONNECTED = "connected"
    HEARTBEAT = "heartbeat"
    FATAL = "fatal"
    ADD = "add"
    CANCEL = "cancel"
    EVENTS = "events"
    STATUS = "status"
    GET_STATS = "get_stats"
    STATS = "stats"
    SHUTDOWN = "shutdown"
    RESET_PREFIX_CACHE = "reset_prefix_cache"


@dataclass(kw_only=True, slots=True)
class Ready:
    OP = Op.READY
    stage: int
    capacity_blocks: int
    """KV blocks this stage can hold."""
    layers: tuple[int, int]
    pid: int
    fingerprint: str
    rank: int = 0
    """This process's rank in its stage (0: the leader)."""
    store_port: int | None = None
    """The port of the torch.distributed store this process hosts for its world (the first rank of
    a world: :func:`stagewise.parallel.groups.world_ranks`; on loopback for a stage's own world,
    :func:`~stagewise.parallel.groups.store_host`); None: it hosts none."""


@dataclass(kw_only=True, slots=True)
class Setup:
    OP = Op.SETUP
    num_blocks: int
    """KV blocks every stage allocates (the smallest capacity any stage reported)."""
    next: tuple[str, int] | None
    """Address of the stage this one dials (the last stage dials stage 0); None with one stage."""
    transport: str
    """This stage's outgoing hop: a registered transport (:mod:`stagewise.transport.registry`), never auto."""
    microbatches: int
    store: tuple[str, int] | None = None
    """The store of this process's torch.distributed world (its stage's ranks, or the run's with the
    ``torch`` transport), hosted by the world's first rank; None: it joins none."""
    followers: list[tuple[str, int]] | None = None
    """To a stage's leader: the addresses of the stage's other ranks, which it hands each step."""


@dataclass(kw_only=True, slots=True)
class Connected:
    OP = Op.CONNECTED
    stage: int


@dataclass(kw_only=True, slots=True)
class Heartbeat:
    OP = Op.HEARTBEAT


@dataclass(kw_only=True, slots=True)
class Fatal:
    OP = Op.FATAL
    message: str
    neighbour: bool
    """The stage lost a neighbour (rather than failing on its own)."""


@dataclass(kw_only=True, slots=True)
class Add:
    OP = Op.ADD
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    images: ImageInputs | None = None
    """The request's images: the frame's tensors ``pixel_values`` and ``image_grid_thw``, not JSON."""
    resumed: int = 0
    """How many of the prompt's last tokens the request generated before a restart."""


@dataclass(kw_only=True, slots=True)
class Cancel:
    OP = Op.CANCEL
    request_id: int


@dataclass(kw_only=True, slots=True)
class Result:
    """A finished request as stage 0 reports it (its text is the front end's)."""

    request_id: int
    token_ids: list[int]
    finish_reason: str
    error: str | None = None
    cached_tokens: int = 0
    """Prompt tokens the prefix cache held."""
    draft_tokens: int = 0
    """Draft tokens proposed for it (speculative decoding)."""
    accepted_tokens: int = 0
    """Of them, those the last stage accepted."""

    def __post_init__(self) -> None:
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason: expected one of {FINISH_REASONS}, got {self.finish_reason!r}")


@dataclass(kw_only=True, slots=True)
class NewToken:
    request_id: int
    token: int
    logprobs: TokenLogprobs | None = None


@dataclass(kw_only=True, slots=True)
class Events:
    OP = Op.EVENTS
    tokens: list[NewToken] = field(default_factory=list)
    """Every new token, in the order they were sampled."""
    done: list[Result] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.tokens or self.done)


@dataclass(kw_only=True, slots=True)
class Status:
    OP = Op.STATUS
    waiting: int
    """Requests in the queue."""
    running: int
    """Active user rows."""
    max_num_seqs: int
    free_blocks: int
    total_blocks: int
    cached_blocks: int = 0
    """Of the free blocks, those the prefix cache keeps."""
    evicted_blocks: int = 0


@dataclass(kw_only=True, slots=True)
class ResetPrefixCache:
    """Stage 0 forgets every cached prefix (requests running go on)."""

    OP = Op.RESET_PREFIX_CACHE


@dataclass(kw_only=True, slots=True)
class GetStats:
    OP = Op.GET_STATS
    trace: bool = False
    reset: bool = False


@dataclass(kw_only=True, slots=True)
class Stats:
    OP = Op.STATS
    stage: int
    layers: tuple[int, int]
    busy_s: float
    send_s: float
    recv_wait_s: float
    steps: int
    tokens: int
    bytes_sent: int
    bytes_received: int
    rejected_frames: int
    wall_s: float
    trace: list[tuple[str, float, float, int]] | None = None
    """(name, start, duration, microbatch) spans: compute, send, recv-wait."""
    ranks: int = 1
    """Processes of the stage (pcp * tp)."""
    collective_s: float = 0.0
    """The leader's time in its groups' collectives (tp, dcp, pcp), inside ``busy_s``."""
    collective_bytes: int = 0
    """Bytes the leader handed to those collectives."""
    collective_calls: int = 0
    fanout_s: float = 0.0
    """The leader's time handing steps to the stage's other ranks, inside ``busy_s``."""
    fanout_bytes: int = 0
    constraint_s: float = 0.0
    """The leader's time on structured output (masks, applying them, advancing the constraints),
    inside ``busy_s``: the last stage's."""
    kv_blocks: int = 0
    """Full-attention KV blocks each rank of the stage allocated (its sliding-window pools beside)."""
    kv_block_bytes: int = 0
    """Bytes of the rank's whole cache per one of those blocks: ``kv_blocks x kv_block_bytes`` is
    its cache's size, sliding-window pools included."""


@dataclass(kw_only=True, slots=True)
class Shutdown:
    OP = Op.SHUTDOWN


Message = (Ready | Setup | Connected | Heartbeat | Fatal | Add | Cancel | Events | Status | GetStats | Stats
           | Shutdown | ResetPrefixCache)
_BY_OP: dict[str, type] = {cls.OP.value: cls for cls in typing.get_args(Message)}


def to_frame(msg: Message, *, stage_from: int = 0) -> Frame:
    images = msg.images if isinstance(msg, Add) else None
    body = {"op": msg.OP.value, **{f.name: _plain(getattr(msg, f.name)) for f in dataclasses.fields(msg)
                                   if f.name != "images"}}
    tensors = {} if images is None else {"pixel_values": images.pixel_values.contiguous(),
                                         "image_grid_thw": images.image_grid_thw.contiguous()}
    return Frame(step_kind=StepKind.CONTROL, stage_from=stage_from, control=body, tensors=tensors)


def from_frame(frame: Frame) -> Message:
    """The message of a CONTROL frame; ProtocolError naming the op or field that is wrong."""
    body = frame.control
    if frame.step_kind != StepKind.CONTROL or not isinstance(body, dict):
        raise ProtocolError(f"expected a CONTROL frame with a JSON object, got {frame.step_kind!r}")
    op = body.get("op")
    cls = _BY_OP.get(op) if isinstance(op, str) else None
    if cls is None:
        raise ProtocolError(f"op: unknown control message {op!r}; expected one of {sorted(_BY_OP)}")
    msg = _build(cls, {k: v for k, v in body.items() if k not in ("op", "images")}, op)
    if isinstance(msg, Add) and ("pixel_values" in frame.tensors or "image_grid_thw" in frame.tensors):
        try:
            msg.images = ImageInputs(pixel_values=frame.tensors["pixel_values"],
                                     image_grid_thw=frame.tensors["image_grid_thw"])
        except (KeyError, ValueError) as err:
            raise ProtocolError(f"add.images: tensors pixel_values and image_grid_thw go together ({err})") from None
    return msg


def refused_request(frame: Frame, err: ProtocolError) -> Result | None:
    """The error result of the request an Add that :func:`from_frame` refused names (None when
    the frame names none): the request ends with ``err`` instead of never."""
    body = frame.control
    rid = body.get("request_id") if isinstance(body, dict) and body.get("op") == Op.ADD.value else None
    if isinstance(rid, bool) or not isinstance(rid, int):
        return None
    return Result(request_id=rid, token_ids=[], finish_reason="error",
                  error=f"stage 0 could not read the request: {err}")


def _plain(value):
    """A message field as JSON: dataclasses as objects, tuples as lists."""
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


@functools.cache
def _fields(cls: type) -> tuple[dict, frozenset]:
    return typing.get_type_hints(cls), frozenset(f.name for f in dataclasses.fields(cls))


def _build(cls: type, data: dict, where: str):
    hints, names = _fields(cls)
    unknown = sorted(set(data) - names)
    if unknown:
        raise ProtocolError(f"{where}: unknown fields {unknown}")
    kwargs = {}
    for name in names & set(data):
        kwargs[name] = _value(data[name], hints[name], f"{where}.{name}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:
        raise ProtocolError(f"{where}: {err}") from None


def _value(value, hint, where: str):
    """``value`` (decoded JSON) checked against the type ``hint``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _value(value, inner[0], where) if len(inner) == 1 else value
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ProtocolError(f"{where}: expected an object, got {value!r:.80}")
        return _build(hint, value, where)
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise ProtocolError(f"{where}: expected a list, got {value!r:.80}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ProtocolError(f"{where}: expected {len(args)} items, got {len(value)}")
            return tuple(_value(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        item = args[0] if args else typing.Any
        items = [_value(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if hint in (int, str, bool):
        if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
            raise ProtocolError(f"{where}: expected {hint.__name__}, got {value!r:.80}")
        return value
    if hint is dict or origin is dict:  # a JSON object the dataclass checks itself (a JSON schema)
        if not isinstance(value, dict):
            raise ProtocolError(f"{where}: expected an object, got {value!r:.80}")
        return value
    if hint is typing.Any:
        return value
    raise ProtocolError(f"{where}: expected {hint}, got {value!r:.80}")
