"""The stage protocol's messages: every control message and every pipeline message survives its
frame and the codec unchanged, and a message with a wrong or missing field is refused naming the
field, never half-read."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from stagewise.engine.params import SamplingParams, SamplingRequest, TokenLogprobs
from stagewise.model.batch import StepBatch
from stagewise.pipeline import messages, protocol
from stagewise.pipeline.protocol import ProtocolError, StageShape
from stagewise.transport import decode_frame, encode_frame
from stagewise.transport.frame import Frame, RowFlags, StepKind

PARAMS = SamplingParams(max_new_tokens=7, temperature=0.5, top_k=3, top_p=0.9, seed=2**63, stop=["x"],
                        stop_token_ids=[4], ignore_eos=True, repetition_penalty=1.3, presence_penalty=-0.5,
                        frequency_penalty=2.0, min_p=0.05, logprobs=3)
CONTROL = [
    messages.Ready(stage=2, capacity_blocks=99, layers=(4, 9), pid=1234, fingerprint="abc"),
    messages.Ready(stage=1, capacity_blocks=8, layers=(0, 4), pid=7, fingerprint="abc", rank=0, store_port=29500),
    messages.Setup(num_blocks=64, next=("10.0.0.2", 7100), transport="shm", microbatches=3, store=("h", 5)),
    messages.Setup(num_blocks=1, next=None, transport="tcp", microbatches=1),
    messages.Connected(stage=1), messages.Heartbeat(), messages.Shutdown(),
    messages.Fatal(message="boom", neighbour=True),
    messages.Add(request_id=2**64 - 1, prompt_ids=[1, 2, 3], params=PARAMS),
    messages.Cancel(request_id=5),
    messages.Events(tokens=[messages.NewToken(request_id=1, token=5),
                            messages.NewToken(request_id=2, token=7, logprobs=TokenLogprobs(
                                token=7, logprob=-0.25, top=((7, -0.25), (3, -1.5))))],
                    done=[messages.Result(request_id=3, token_ids=[5, 6], finish_reason="stop"),
                          messages.Result(request_id=4, token_ids=[], finish_reason="error", error="e")]),
    messages.Status(waiting=1, running=2, max_num_seqs=3, free_blocks=4, total_blocks=5),
    messages.GetStats(trace=True, reset=False),
    messages.Stats(stage=0, layers=(0, 3), busy_s=1.5, send_s=0.0, recv_wait_s=2.0, steps=3, tokens=9,
                   bytes_sent=10, bytes_received=11, rejected_frames=0, wall_s=4.0,
                   trace=[("compute", 1.0, 0.5, 0), ("send", 1.5, 0.1, -1)]),
]


def wire(frame: Frame) -> Frame:
    return decode_frame(encode_frame(frame))


@pytest.mark.parametrize("msg", CONTROL, ids=lambda m: type(m).__name__)
def test_control_messages_round_trip(msg):
    assert messages.from_frame(wire(messages.to_frame(msg, stage_from=1))) == msg


@pytest.mark.parametrize("body, match", [
    ({"op": "launch"}, "unknown control message 'launch'"),
    ({}, "unknown control message None"),
    ({"op": "ready", "stage": "1", "capacity_blocks": 1, "layers": [0, 1], "pid": 1, "fingerprint": "f"},
     r"ready\.stage: expected int, got '1'"),
    ({"op": "ready", "stage": True, "capacity_blocks": 1, "layers": [0, 1], "pid": 1, "fingerprint": "f"},
     r"ready\.stage: expected int, got True"),
    ({"op": "ready", "stage": 1, "capacity_blocks": 1, "layers": [0], "pid": 1, "fingerprint": "f"},
     r"ready\.layers: expected 2 items, got 1"),
    ({"op": "cancel"}, r"cancel: .*request_id"),
    ({"op": "cancel", "request_id": 1, "why": "x"}, r"cancel: unknown fields \['why'\]"),
    ({"op": "add", "request_id": 1, "prompt_ids": [1, "2"], "params": {}}, r"add\.prompt_ids\[1\]: expected int"),
    ({"op": "add", "request_id": 1, "prompt_ids": [1], "params": {"top_p": 2.0}}, r"add\.params: .*top_p"),
    ({"op": "events", "done": [{"request_id": 1, "token_ids": [], "finish_reason": "odd"}]},
     r"events.done\[0\]: .*finish_reason"),
])
def test_bad_control_messages_name_the_field(body, match):
    with pytest.raises(ProtocolError, match=match):
        messages.from_frame(wire(Frame(step_kind=StepKind.CONTROL, control=body)))


SHAPE = StageShape(index=1, hidden_size=8, dtype=torch.float32, max_model_len=32, device=torch.device("cpu"))


def step_message(sampling=None) -> protocol.Step:
    batch = StepBatch(request_ids=[7, 3, 9], num_prefills=1, query_lens=[4, 1, 1], context_lens=[0, 11, 5],
                      positions=torch.tensor([0, 1, 2, 3, 11, 5]), hidden_states=torch.randn(6, 8))
    return protocol.Step(step_id=12, group=2, batch=batch, sampling=sampling)


def test_a_step_crosses_the_wire_as_one_conversion_each_way():
    sampling = protocol.encode_sampling({7: SamplingRequest.of(PARAMS, [9, 8, 7])})
    sent = step_message(sampling)
    frame = wire(protocol.to_frame(sent, stage_from=0, stage_to=1))
    assert frame.step_kind == StepKind.MIXED and frame.token_index == 11
    got = protocol.from_frame(frame, SHAPE)
    b, want = got.batch, sent.batch
    assert (got.step_id, got.group) == (12, 2)
    assert (b.request_ids, b.num_prefills, b.query_lens, b.context_lens) == (
        want.request_ids, want.num_prefills, want.query_lens, want.context_lens)
    assert torch.equal(b.positions, want.positions) and torch.equal(b.hidden_states, want.hidden_states)
    assert protocol.decode_sampling(got.sampling) == {7: SamplingRequest(PARAMS, (9, 8, 7))}
    assert protocol.encode_sampling({}) is None and protocol.decode_sampling(None) == {}


def test_prefill_chunks_carry_their_first_position_and_which_ends_its_prompt():
    batch = StepBatch(request_ids=[7, 8, 3], num_prefills=2, query_lens=[3, 2, 1], context_lens=[5, 0, 11],
                      positions=torch.tensor([5, 6, 7, 0, 1, 11]), hidden_states=torch.randn(6, 8),
                      last_chunk=[True, False, True])
    frame = wire(protocol.to_frame(protocol.Step(step_id=1, group=0, batch=batch), stage_from=0, stage_to=1))
    assert [(r.first_position, r.num_tokens, r.flags) for r in frame.rows] == [
        (5, 3, RowFlags.PREFILL | RowFlags.LAST_PREFILL_CHUNK), (0, 2, RowFlags.PREFILL), (11, 1, RowFlags.NONE)]
    got = protocol.from_frame(frame, SHAPE).batch
    assert (got.context_lens, got.last_chunk, got.sampled_ids()) == ((5, 0, 11), (True, False, True), (7, 3))
    assert torch.equal(got.positions, batch.positions)
    frame.rows[2].flags = RowFlags.LAST_PREFILL_CHUNK
    with pytest.raises(ProtocolError, match=r"rows\[2\]: LAST_PREFILL_CHUNK on a decode row"):
        protocol.from_frame(wire(frame), SHAPE)


def test_a_step_carries_the_drafts_its_rows_verify():
    batch = StepBatch(request_ids=[7, 8, 3], num_prefills=2, query_lens=[3, 4, 1], context_lens=[5, 9, 11],
                      positions=torch.tensor([5, 6, 7, 9, 10, 11, 12, 11]), hidden_states=torch.randn(8, 8),
                      draft_tokens=[(), (40, 41, 42), ()])
    frame = wire(protocol.to_frame(protocol.Step(step_id=1, group=0, batch=batch), stage_from=0, stage_to=1))
    got = protocol.from_frame(frame, SHAPE).batch
    assert got.draft_tokens == ((), (40, 41, 42), ()) and got.logit_rows() == [2, 3, 4, 5, 6, 7]
    frame.tensors["draft_counts"] = torch.tensor([0, 2, 0])
    with pytest.raises(ProtocolError, match=r"draft_counts'/'draft_tokens'"):
        protocol.from_frame(wire(frame), SHAPE)
    frame.tensors["draft_counts"] = torch.tensor([0, 0, 3])
    with pytest.raises(ValueError, match="StepBatch.draft_tokens"):  # drafts on a one-token decode row
        protocol.from_frame(wire(frame), SHAPE)


@pytest.mark.parametrize("msg", [
    protocol.Tokens(step_id=3, group=1, request_ids=[4, 5], tokens=[100, 2**40]),
    protocol.Tokens(step_id=5, group=1, request_ids=[], tokens=[]),  # a step of chunks that sample nothing
    protocol.Tokens(step_id=4, group=0, request_ids=[4, 5], tokens=[1, 2],
                    logprobs=[None, TokenLogprobs(token=2, logprob=-0.125, top=((2, -0.125), (9, -3.0)))]),
    protocol.Tokens(step_id=6, group=0, request_ids=[4, 5, 6], tokens=[1, 2, 3, 4, 5, 6], counts=[1, 3, 2],
                    logprobs=[None] * 5 + [TokenLogprobs(token=6, logprob=-0.5, top=())]),  # drafts accepted
    protocol.Free(request_ids=[1, 2, 3]),
    protocol.StepFailed(step_id=9, group=0, message="stage 2 step failed: x"),
], ids=lambda m: type(m).__name__)
def test_pipeline_messages_round_trip(msg):
    assert protocol.from_frame(wire(protocol.to_frame(msg, stage_from=2, stage_to=0)), None) == msg


def test_steps_that_do_not_fit_the_stage_are_refused():
    good = protocol.to_frame(step_message(), stage_from=0, stage_to=1)

    def refused(frame, match):
        with pytest.raises(ProtocolError, match=match):
            protocol.from_frame(wire(frame), SHAPE)

    refused(Frame(**{**_fields(good), "stage_to": 2}), "stage_to is 2, this is stage 1")
    refused(Frame(**{**_fields(good), "tensors": {"hidden": torch.randn(6, 8).double()}}), "expected dtype")
    rows = list(good.rows)
    refused(Frame(**{**_fields(good), "rows": [rows[1], rows[0], rows[2]]}), "prefill rows must come before")
    rows[2].first_position = 40
    refused(Frame(**{**_fields(good), "rows": rows}), "beyond max_model_len 32")
    refused(Frame(**{**_fields(good), "tensors": {"hidden": good.tensors["hidden"],
                                                  "sampling": torch.zeros(2, 2, dtype=torch.uint8)}}),
            r"tensors\['sampling'\]: expected uint8 bytes")
    with pytest.raises(ProtocolError, match="is not a pipeline message"):
        protocol.from_frame(wire(good), None)  # no steps on the feedback link
    bad = torch.frombuffer(bytearray(b'{"7":{"params":{"top_k":-1}}}'), dtype=torch.uint8)
    with pytest.raises(ProtocolError, match=r"tensors\['sampling'\]\['7'\]: .*top_k"):
        protocol.decode_sampling(bad)


def _fields(frame: Frame) -> dict:
    return {k: getattr(frame, k) for k in ("step_kind", "step_id", "microbatch", "stage_from", "stage_to",
                                           "token_index", "rows", "tensors", "control")}


@contextlib.contextmanager
def stage_and_driver():
    """A stage 0 of only its control link (no model, no process; its stats counted) and the
    driver's end of that link, over TCP on loopback."""
    from stagewise.pipeline.process import StageProcess
    from stagewise.pipeline.roles import StageStats
    from stagewise.transport import Hello, tcp

    hello = Hello(fingerprint="plan", stage_from=None, stage_to=0, role="driver")
    stage = StageProcess.__new__(StageProcess)
    stage.stats, stage.index = StageStats(), 0
    with tcp.listen(hello=hello) as lis:
        accept = threading.Thread(target=lambda: setattr(stage, "control", lis.accept(5)))
        accept.start()
        driver = tcp.connect(*lis.address, hello=hello, timeout=5)
        accept.join()
    try:
        yield stage, driver
    finally:
        driver.close()
        stage.control.close()


def test_a_stage_reads_a_driver_message_that_arrives_in_parts():
    """A large Add (a prompt with images) can reach a stage's control link over several reads. The
    stage keeps what has come and reads the rest on a later pass: it neither fails nor drops it."""
    from stagewise.transport import encode_frame, tcp

    add = messages.Add(request_id=9, prompt_ids=list(range(50_000)), params=PARAMS)
    body = encode_frame(messages.to_frame(add))
    record = tcp.RECORD.pack(tcp.RECORD_MARKER, len(body)) + body
    with stage_and_driver() as (stage, driver):
        driver._sock.sendall(record[: len(record) // 2])  # half a record, as a slow network delivers it
        assert stage.control.poll(5)
        assert stage._driver_messages() == []
        driver._sock.sendall(record[len(record) // 2:])
        assert stage.control.poll(5) and stage._driver_messages() == [add]


def test_an_add_stage_0_cannot_read_ends_its_request_with_the_error():
    """A driver of another version (or a corrupted frame) sends an Add this stage refuses: the
    request ends with an error naming the field, so the driver does not wait for it forever; a
    refused frame that names no request is only counted."""
    from stagewise.pipeline.roles import Head

    bad = messages.to_frame(messages.Add(request_id=41, prompt_ids=[1, 2], params=PARAMS))
    bad.control["params"]["top_k"] = "many"
    anonymous = messages.to_frame(messages.Cancel(request_id=3))
    anonymous.control.pop("request_id")
    with stage_and_driver() as (stage, driver):
        driver.send(bad)
        driver.send(anonymous)
        assert stage.control.poll(5)
        got = []
        while len(got) < 1 or stage.control.poll(0.2):
            got += stage._driver_messages()
        [ended] = got
        assert (ended.request_id, ended.finish_reason) == (41, "error") and "top_k" in ended.error
        assert stage.stats.rejected_frames == 2
    head = Head.__new__(Head)
    head._events = messages.Events()  # a head without an engine: only its events
    head.on_message(ended)
    assert head._events.done == [ended]
