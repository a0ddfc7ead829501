"""A stage of several ranks (tensor and context parallel): its leader hands every step to the
others, which run it in lockstep, their collectives meeting the leader's.

Only the leader (stage rank 0) speaks the pipeline protocol: it receives each step from the
previous stage (or schedules it, on stage 0), and sends the result on. Before it runs a step it
sends the same :class:`~stagewise.pipeline.protocol.Step` frame (the rows, and the stage's input:
token ids on stage 0, the previous stage's hidden states elsewhere) to each other rank over a
channel of its own (shared memory on one host, TCP across hosts), each request it frees as
a :class:`~stagewise.pipeline.protocol.Free`, and a reset of its KV pools as a
:class:`~stagewise.pipeline.protocol.ResetKV`. The other ranks' outputs are the same hidden
states as the leader's (after the all-reduce) or, on the last stage, nothing: the logits are
gathered to the leader, which alone samples.

One receiver, broadcast over our channels, rather than every rank receiving from its peer rank
of the previous stage: stages may differ in size, and a step's input crosses the hop once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence

from stagewise.engine.executor import Executor
from stagewise.model.batch import StepBatch
from stagewise.pipeline import protocol
from stagewise.pipeline.protocol import Free, ResetKV, StageShape, Step
from stagewise.transport.channel import Channel


class Fanout:
    """The leader's side: one channel to each other rank of the stage (implements
    :class:`~stagewise.engine.executor.Mirror`)."""

    def __init__(self, channels: Sequence[Channel], *, stage: int) -> None:
        self.channels, self.stage = list(channels), stage
        self.seconds = 0.0
        """Time spent handing steps and frees to the other ranks."""
        self.bytes = 0

    def _send(self, msg: protocol.Message) -> None:
        start = time.perf_counter()
        frame = protocol.to_frame(msg, stage_from=self.stage, stage_to=self.stage)
        for channel in self.channels:
            before = channel.stats.bytes_sent
            channel.send(frame)
            self.bytes += channel.stats.bytes_sent - before
        self.seconds += time.perf_counter() - start

    def run(self, batch: StepBatch) -> None:
        self._send(Step(step_id=0, group=0, batch=batch))

    def free(self, request_ids: Sequence[Hashable]) -> None:
        self._send(Free(request_ids=[int(r) for r in request_ids]))

    def reset_kv(self) -> None:
        self._send(ResetKV())

    def close(self) -> None:
        for channel in self.channels:
            channel.close()


def serve_follower(executor: Executor, channel: Channel, shape: StageShape,
                   between: Callable[[], None] = lambda: None) -> None:
    """Run the leader's steps and frees, in its order, until the channel closes. ``between`` is
    called between frames (it answers the driver; raising stops the loop)."""
    while True:
        between()
        try:
            frame = channel.recv(timeout=0.05)
        except TimeoutError:
            continue
        msg = protocol.from_frame(frame, shape)
        if isinstance(msg, Step):
            executor.run(msg.batch)
        elif isinstance(msg, Free):
            executor.free(msg.request_ids)
        elif isinstance(msg, ResetKV):
            executor.reset_kv()
        else:
            raise protocol.ProtocolError(f"the stage's leader sent a {type(msg).__name__}; expected steps, frees "
                                         "and resets")
