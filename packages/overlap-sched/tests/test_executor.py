"""The executor: stage order, waiting where results are read, the state, and every error."""

from __future__ import annotations

import json

import pytest

from overlap_sched import (
    Op,
    OpFailed,
    OpListError,
    Recorder,
    State,
    StateError,
    Yield,
    run,
    run_overlapped,
    stages,
)


def logging_ops(log: list, names: str) -> list:
    """Ops that append (microbatch, name) to log; "|" is a Yield."""
    return [
        Yield() if name == "|" else Op(name, lambda s, name=name: log.append((s.microbatch, name)))
        for name in names.split()
    ]


def test_the_second_microbatch_runs_delta_stages_behind():
    log = []
    run_overlapped(logging_ops(log, "a | b | c | d"), [State(), State()], delta_stages=1)
    assert log == [
        (0, "a"),
        (0, "b"), (1, "a"),
        (0, "c"), (1, "b"),
        (0, "d"), (1, "c"),
        (1, "d"),
    ]  # fmt: skip


@pytest.mark.parametrize("delta", [0, 2, 3])
def test_every_op_runs_once_per_microbatch_in_its_order(delta):
    log = []
    run_overlapped(logging_ops(log, "a b | c | d"), [State(), State()], delta_stages=delta)
    for microbatch in (0, 1):
        assert [name for m, name in log if m == microbatch] == ["a", "b", "c", "d"]
    if delta == 3:  # all of A, then all of B
        assert [m for m, _ in log] == [0] * 4 + [1] * 4
    if delta == 0:
        assert log[:4] == [(0, "a"), (0, "b"), (1, "a"), (1, "b")]


def test_one_batch_runs_every_op_and_ignores_yields():
    log = []
    run(logging_ops(log, "a | b c | d"), State())
    assert log == [(0, "a"), (0, "b"), (0, "c"), (0, "d")]


class Event:
    """What ep_comm's EventOverlap offers: current_stream_wait()."""

    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def current_stream_wait(self) -> None:
        self.log.append(("wait", self.name))


def test_an_event_is_waited_on_when_its_result_is_first_read_never_earlier():
    log = []

    def send(state):
        state.sent = "rows"
        log.append(("send", state.microbatch))
        return Event(log, f"send {state.microbatch}")

    def other(state):
        log.append(("other", state.microbatch))

    def receive(state):
        log.append(("receive", state.microbatch, state.sent))

    ops = [Op("send", send), Yield(), Op("other", other), Op("receive", receive)]
    run_overlapped(ops, [State(), State()], delta_stages=0)
    assert log == [
        ("send", 0),
        ("send", 1),
        ("other", 0),
        ("wait", "send 0"),
        ("receive", 0, "rows"),
        ("other", 1),
        ("wait", "send 1"),
        ("receive", 1, "rows"),
    ]


def test_a_receive_hook_is_called_once_where_its_result_is_read():
    calls = []

    def send(state):
        state.received = "later"
        return lambda: calls.append(state.microbatch)

    def use(state):
        assert calls == []  # not before the op that reads it
        assert state.received == "later"
        assert calls == [0]
        state.pop("received")

    run([Op("send", send), Yield(), Op("use", use)], State())
    assert calls == [0]


def test_results_no_op_read_are_waited_on_before_returning():
    log = []

    def send(state):
        state.sent = 1
        return Event(log, "unread")

    run_overlapped([Op("send", send)], [State(), State()], 0)
    assert log == [("wait", "unread"), ("wait", "unread")]


def test_the_state_refuses_to_overwrite_a_key():
    state = State(microbatch=1, x=1)
    with pytest.raises(StateError, match="microbatch 1: state key 'x' is set already"):
        state.x = 2
    assert state.pop("x") == 1
    state.x = 3
    assert state.x == 3
    with pytest.raises(StateError, match="no state key 'y'"):
        state.y  # noqa: B018


def test_an_op_that_overwrites_a_key_is_named():
    def twice(state):
        state.x = 1
        state.x = 2

    with pytest.raises(OpFailed, match=r"op 'twice' of microbatch 0 .*'x' is set already"):
        run([Op("twice", twice)], State())


@pytest.mark.parametrize(
    ("ops", "message"),
    [
        ([], "empty"),
        ([Yield(), Op("a", print)], "begins with a Yield"),
        ([Op("a", print), Yield()], "ends with a Yield"),
        (
            [Op("a", print), Yield(), Yield(), Op("b", print)],
            "two Yields in a row at positions 1 and 2",
        ),
        ([Op("a", print), Yield, Op("b", print)], "the Yield class: write Yield()"),
        ([Op("a", print), 42], "position 1 is 42"),
    ],
)
def test_misplaced_yields_and_entries_that_are_not_ops(ops, message):
    with pytest.raises(OpListError, match=message):
        stages(ops)
    with pytest.raises(OpListError, match=message):
        run_overlapped(ops, [State(), State()], 0)


def test_microbatches_whose_op_lists_disagree():
    log = []
    a = logging_ops(log, "x | y")
    with pytest.raises(OpListError, match=r"microbatch 1's op list differs.*2 stages against 1"):
        run_overlapped([a, logging_ops(log, "x y")], [State(), State()], 0)
    with pytest.raises(OpListError, match=r"stage 1 is \['y'\] against \['z'\]"):
        run_overlapped([a, logging_ops(log, "x | z")], [State(), State()], 0)
    assert log == []  # nothing ran
    run_overlapped([a, logging_ops(log, "x | y")], [State(), State()], 1)
    assert len(log) == 4


def test_bad_counts_of_states_and_stages():
    ops = [Op("a", print), Yield(), Op("b", print)]
    with pytest.raises(OpListError, match="two microbatches, got 3"):
        run_overlapped(ops, [State(), State(), State()], 0)
    with pytest.raises(OpListError, match=r"delta_stages must be in \[0, 2\]"):
        run_overlapped(ops, [State(), State()], 3)


def test_an_empty_microbatch_beside_a_full_one_is_refused_two_empty_ones_run():
    log = []
    ops = logging_ops(log, "a | b")
    with pytest.raises(OpListError, match="microbatch 1 is empty while microbatch 0 has 5"):
        run_overlapped(ops, [State(num_tokens=5), State(num_tokens=0)], 0)
    run_overlapped(ops, [State(num_tokens=0), State(num_tokens=0)], 0)  # a rank without tokens
    assert len(log) == 4


def test_an_op_that_raises_is_named_and_leaves_nothing_in_flight():
    log = []

    def send(state):
        state.sent = True
        return Event(log, f"send {state.microbatch}")

    def fail(state):
        if state.microbatch == 1:
            raise RuntimeError("out of memory")

    ops = [
        Op("send", send),
        Yield(),
        Op("fail", fail),
        Op("read", lambda s: s.pop("sent") and None),
    ]
    with pytest.raises(
        OpFailed,
        match=r"op 'fail' of microbatch 1 \(stage 2 of 2\) raised "
        "RuntimeError: out of memory",
    ) as failure:
        run_overlapped(ops, [State(), State()], 0)
    assert isinstance(failure.value.__cause__, RuntimeError)
    assert ("wait", "send 1") in log  # microbatch 1's send was waited for before raising
    assert log.count(("wait", "send 0")) == 1


def test_a_failing_hook_while_cleaning_up_is_noted_not_hidden():
    def send(state):
        state.sent = True

        def hook():
            raise TimeoutError("peer 3 never answered")

        return hook

    def fail(state):
        raise ValueError("bad rows")

    with pytest.raises(OpFailed, match="bad rows") as failure:
        run([Op("send", send), Yield(), Op("fail", fail)], State())
    assert "peer 3 never answered" in "".join(failure.value.__notes__)


def test_a_communication_op_must_say_what_it_wrote_and_return_a_known_kind():
    with pytest.raises(OpListError, match="returned Event but wrote no state key"):
        run([Op("send", lambda s: Event([], "x"))], State())

    def odd(state):
        state.y = 1
        return 42

    with pytest.raises(OpListError, match="returned int: expected None, an event"):
        run([Op("odd", odd)], State())


def test_the_trace_has_one_span_per_op_per_microbatch(tmp_path):
    log = []

    def send(state):
        state.sent = True
        return Event(log, "send")

    ops = [
        Op("a", lambda s: None),
        Op("send", send),
        Yield(),
        Op("b", lambda s: s.pop("sent") and None),
    ]
    recorder = Recorder(cuda=False, rank=3)
    run_overlapped(ops, [State(), State()], 0, recorder=recorder)
    trace = json.loads(recorder.save(tmp_path / "t.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["cat"] == "op"]
    assert sorted((e["name"], e["args"]["microbatch"]) for e in spans) == [
        ("a", 0), ("a", 1), ("b", 0), ("b", 1), ("send", 0), ("send", 1),
    ]  # fmt: skip
    assert {e["tid"] for e in spans if e["name"] == "send"} == {"communication"}
    assert {e["tid"] for e in spans if e["name"] != "send"} == {"compute"}
    assert all(e["pid"] == 3 and e["ph"] == "X" and e["dur"] >= 0 for e in spans)
    summary = recorder.summary()
    assert summary["total_us"] >= summary["compute_us"] > 0
