"""The resize state machine (coordinator/leader/resize.py) and the protocol it drives, on a model
of the broker, etcd, producers and consumers (tests/unit/resize_world.py)."""

from __future__ import annotations

from collections import defaultdict

import pytest
from hypothesis import event as note
from hypothesis import given, settings
from hypothesis import strategies as st
from partq.coordinator.leader import resize
from partq.coordinator.leader.resize import (
    Bind,
    Bound,
    Cut,
    Declare,
    Declared,
    Delete,
    Deleted,
    Drained,
    Fence,
    Fenced,
    NotEmpty,
    Phase,
    Resumed,
    State,
    Switch,
    Switched,
    Unbind,
)
from partq.producer.layout import Layout

from partq.kernel.errors import MalformedValue, UsageError
from tests.unit.resize_world import Message, World

KEYS = [f"k{i}" for i in range(10)]


def run(state: State, *events: resize.Event) -> tuple[State, list[resize.Action]]:
    issued: list[resize.Action] = []
    for event in events:
        state, actions = resize.step(state, event)
        issued.extend(actions)
    return state, issued


def test_a_shrink_goes_through_every_phase_in_order() -> None:
    # Given a resize 4 -> 2 just requested
    state, actions = resize.begin(Layout(4), 2, running=None)
    assert (state.phase, actions) == (Phase.REQUESTED, [Declare(())])
    # When each step is done / Then the next one is asked for, in the protocol's order
    state, actions = run(state, Declared())
    assert (state.phase, actions) == (Phase.DECLARED, [Unbind(Layout(4))])
    state, actions = run(state, Cut())
    assert actions == [Fence(0, p) for p in range(4)]
    state, actions = run(state, Fenced(0), Fenced(1), Fenced(2))
    assert (state.phase, actions) == (Phase.CUT, [])
    state, actions = run(state, Fenced(3))
    assert (state.phase, actions) == (Phase.FENCED, [Bind(Layout(2, 1))])
    state, actions = run(state, Bound())
    assert actions == [Switch(Layout(4), Layout(2, 1))]
    state, actions = run(state, Switched())
    assert (state.phase, actions) == (Phase.SWITCHED, [])
    # and the queues only the old layout had are deleted once every old partition drained
    state, actions = run(state, *(Drained(0, p) for p in range(4)))
    assert (state.phase, actions) == (Phase.DRAINED, [Delete(2), Delete(3)])
    state, actions = run(state, Deleted(2), Deleted(3))
    assert (state.phase, actions) == (Phase.RETIRED, [])


def test_a_grow_declares_the_new_queues_and_retires_nothing() -> None:
    state, actions = resize.begin(Layout(2), 4, running=None)
    assert actions == [Declare((2, 3))]
    state, _ = run(state, Declared(), Cut(), Fenced(0), Fenced(1), Bound())
    # Given both fences handled before the switch (consumers are quick)
    state, _ = run(state, Drained(0, 0), Drained(0, 1))
    assert state.phase is Phase.BOUND
    # When the switch is recorded / Then nothing is left to do: retired at once
    state, actions = run(state, Switched())
    assert (state.phase, actions) == (Phase.RETIRED, [])


@pytest.mark.parametrize(
    ("current", "asked", "running", "message"),
    [
        (
            12,
            16,
            State(Layout(12).resize(24), Phase.SWITCHED),
            "a resize to 24 partitions is already running (switched): "
            "wait for it to finish before asking for another",
        ),
        (12, 0, None, "--partitions 0 is out of range: give 1 to 65536"),
        (12, 12, None, "the stream already has 12 partitions: give another count"),
    ],
)
def test_refusals_are_one_line(
    current: int, asked: int, running: State | None, message: str
) -> None:
    with pytest.raises(UsageError) as raised:
        resize.begin(Layout(current), asked, running)
    assert str(raised.value) == message


def test_a_finished_resize_does_not_block_the_next() -> None:
    done = State(Layout(12).resize(24), Phase.RETIRED)
    state, _ = resize.begin(Layout(24, 1), 16, running=done)
    assert state.resize.new == Layout(16, 2)


def test_a_queue_with_messages_is_never_deleted_and_is_tried_again() -> None:
    # Given a shrink whose old partitions all drained
    state, _ = resize.begin(Layout(3), 2, running=None)
    state, _ = run(state, Declared(), Cut(), *(Fenced(p) for p in range(3)), Bound(), Switched())
    state, actions = run(state, *(Drained(0, p) for p in range(3)))
    assert actions == [Delete(2)]
    # When the broker refuses: the queue has messages
    state, actions = run(state, NotEmpty(2))
    # Then it is kept, shown, and not retired; a retry asks again
    assert (state.phase, state.not_empty, actions) == (Phase.DRAINED, {2}, [])
    assert resize.step(state, Resumed()) == (state, [Delete(2)])
    state, _ = run(state, Deleted(2))
    assert (state.phase, state.not_empty) == (Phase.RETIRED, frozenset())


def test_answers_out_of_phase_and_repeats_change_nothing() -> None:
    state, _ = resize.begin(Layout(2), 3, running=None)
    for event in (Cut(), Fenced(0), Bound(), Switched(), Deleted(0), Drained(0, 0)):
        assert resize.step(state, event) == (state, [])
    state, _ = run(state, Declared(), Cut(), Fenced(0))
    assert resize.step(state, Fenced(0)) == (state, [])
    assert resize.step(state, Drained(7, 0)) == (state, [])  # another epoch's record
    assert resize.step(state, Fenced(5)) == (state, [])  # no such old partition


def test_status_names_the_gates_still_closed() -> None:
    # Given 2 -> 3: new 1 takes keys of old 0 and 1; new 2 of old 0 and 1; new 0 of both
    state, _ = resize.begin(Layout(2), 3, running=None)
    assert resize.waiting(state) == {0: (1,), 1: (0,), 2: (0, 1)}
    state, _ = run(state, Declared(), Cut(), Drained(0, 1))
    assert resize.waiting(state) == {1: (0,), 2: (0,)}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([Declared(), Cut(), Bound(), Switched(), Resumed()]), max_size=8))
def test_the_record_reads_back(events: list[resize.Event]) -> None:
    state, _ = resize.begin(Layout(5, 2), 3, running=None)
    for event in [*events, Fenced(1), Drained(2, 4), NotEmpty(4), Deleted(3)]:
        state, _ = resize.step(state, event)
        assert resize.decode(resize.encode(state)) == state


@pytest.mark.parametrize(
    "raw",
    [
        "",
        "[]",
        '{"v": 2}',
        '{"v": 1, "old": {"epoch": 0, "partitions": 2}, "new": {"epoch": 1, "partitions": 2},'
        ' "phase": "cut", "fenced": [], "drained": [], "deleted": [], "not_empty": []}',
        '{"v": 1, "old": {"epoch": 0, "partitions": 2}, "new": {"epoch": 1, "partitions": 3},'
        ' "phase": "cut", "fenced": [2], "drained": [], "deleted": [], "not_empty": []}',
        '{"v": 1, "old": {"epoch": 0, "partitions": 2}, "new": {"epoch": 1, "partitions": 3},'
        ' "phase": "later", "fenced": [], "drained": [], "deleted": [], "not_empty": []}',
    ],
)
def test_a_malformed_record_is_refused_with_the_reason(raw: str) -> None:
    with pytest.raises(MalformedValue, match="malformed resize record"):
        resize.decode(raw)


# -- the protocol, on the model ---------------------------------------------------------------

SIZES = st.sampled_from([(2, 4), (4, 2), (3, 6), (6, 4), (3, 5), (1, 3), (4, 1), (2, 3)])
# each actor's moves: publishes thrice and consumes once, so that queues fill up and keys wait
ACTORS = (
    *("publish", "publish", "publish", "refresh", "consume"),
    *("lead", "lead", "watch", "crash", "retry"),
)
MOVES = st.lists(
    st.tuples(st.sampled_from(ACTORS), st.integers(min_value=0, max_value=7)),
    min_size=40,
    max_size=300,
)


def handled_in_order(world: World) -> dict[str, list[int]]:
    seen: dict[str, list[int]] = defaultdict(list)
    for message in world.handled:
        seen[message.key].append(message.seq)
    return seen


def play(world: World, moves: list[tuple[str, int]], request_at: int) -> None:
    for n, (move, i) in enumerate(moves):
        if n == request_at:
            world.request()
        match move:
            case "lead" | "watch" | "crash" | "retry":
                getattr(world, move)()
            case _:
                getattr(world, move)(i)
        if world.record is not None:  # a leader may die anywhere: the record always reads
            resize.decode(world.record)
    if world.record is None:
        world.request()


@settings(max_examples=400, deadline=None)
@given(
    SIZES,
    MOVES,
    st.integers(min_value=0, max_value=40),
    st.integers(1, 3),
    st.sampled_from(["queue", "key"]),
)
def test_any_interleaving_with_crashes_retires_without_loss_or_reorder(
    sizes: tuple[int, int], moves: list[tuple[str, int]], request_at: int, per_key: int, hold: str
) -> None:
    # Given producers publishing throughout, a leader that may die between any two steps,
    # and producers that may go without reading the layout for the whole resize
    old, new = sizes
    # and consumers that wait at a gate with their whole partition, or with the key alone
    world = World.create(old, new, [KEYS[:4], KEYS[4:7], KEYS[7:]], per_key)
    world.hold = hold
    play(world, moves, request_at)
    # When everything is then left to run
    world.settle()
    for what, times in world.seen.items():
        note(f"{what}: {'yes' if times else 'no'}")
    # Then the resize is retired: only the new layout's queues and bindings are left
    state = resize.decode(world.record or "")
    assert state.phase is Phase.RETIRED
    assert world.spec == Layout(new, 1)
    assert sorted(world.queues) == list(range(new))
    assert world.bindings == {Layout(new, 1).routing_key(q) for q in range(new)}
    # and every message was handled once, each key's in the order its producer sent them
    assert handled_in_order(world) == {key: list(range(per_key)) for key in KEYS}
    assert all(not queue for queue in world.queues.values())
    # and no queue with a message in it was ever asked to be deleted: a refusal found only
    # a fence sent twice (a leader died before it recorded the first), tried again later
    for _, held in world.refused_deletes:
        assert not any(isinstance(m, Message) for m in held)


def test_a_frozen_producer_s_late_publish_is_returned_and_re_routed_after_the_old() -> None:
    # Given 2 -> 4, and a key that moves (old partition 0 or 1, new 2 or 3)
    moving = next(k for k in KEYS if Layout(2).partition_for(k) != Layout(4).partition_for(k))
    world = World.create(2, 4, [[moving]], per_key=2)
    world.publish(0)  # its message 0, under epoch 0
    # When the resize runs to the switch while the producer is frozen (no refresh)
    world.request()
    while world.spec.epoch == 0:
        world.lead()
    # Then its next publish, still under epoch 0, is returned, not put behind the fence
    world.publish(0)
    assert world.producers[0].returned_at == 0
    assert [len(q) for q in world.queues.values()] in ([2, 1, 0, 0], [1, 2, 0, 0])
    # and once it reads the layout it re-routes it under epoch 1, where it waits for the old
    world.refresh(0)
    world.publish(0)
    new_partition = Layout(4).partition_for(moving)
    assert world.queues[new_partition] == [Message(moving, 1, 1)]
    world.consume(new_partition)
    assert world.handled == []
    world.settle()
    assert [m.seq for m in world.handled] == [0, 1]


def test_a_producer_frozen_across_the_whole_resize_keeps_its_order() -> None:
    # Given a producer that published half its messages under epoch 0, then froze
    world = World.create(4, 2, [KEYS], per_key=2)
    for _ in KEYS:
        world.publish(0)
    # When the whole shrink runs and retires without it (no publish, no refresh)
    world.request()
    for _ in range(1_000):
        world.lead()
        world.watch()
        for i in range(len(world.queues)):
            world.consume(i)
        if not resize.decode(world.record or "").running:
            break
    assert world.spec == Layout(2, 1) and sorted(world.queues) == [0, 1]
    # Then its first publish on waking is returned (epoch 0 has no binding left), and once it
    # reads the layout every key's second message is handled after its first
    world.publish(0)
    assert world.producers[0].returned_at == 0
    world.settle()
    assert handled_in_order(world) == {key: [0, 1] for key in KEYS}


@pytest.mark.parametrize(("hold", "handled_while_gated"), [("queue", []), ("key", ["stays"])])
def test_holding_by_key_lets_a_key_that_stays_pass_a_gated_one(
    hold: str, handled_while_gated: list[str]
) -> None:
    # Given 4 -> 2: key "moves" goes from old partition 2 to 0, key "stays" stays in 0
    names = [f"key-{i}" for i in range(100)]
    moves = next(k for k in names if Layout(4).partition_for(k) == 2)
    stays = next(k for k in names if Layout(4).partition_for(k) == 0)
    world = World.create(4, 2, [[moves], [stays]], per_key=2)
    world.hold = hold
    world.publish(0)  # moves#0, under epoch 0, in old partition 2
    world.request()
    while world.spec.epoch == 0:
        world.lead()
    # When moves#1 and then stays#0 are published under epoch 1 into queue 0, behind its fence
    for producer in (0, 0, 1):
        world.refresh(producer)
        world.publish(producer)
    assert [getattr(m, "key", "fence") for m in world.queues[0]] == ["fence", moves, stays]
    for _ in range(3):
        world.consume(0)
    # Then moves#1 waits for old partition 2; stays#0 waits too, unless held by key
    names_handled = ["stays" if m.key == stays else "moves" for m in world.handled]
    assert names_handled == handled_while_gated
    world.settle()
    assert handled_in_order(world) == {moves: [0, 1], stays: [0, 1]}


def test_without_the_gate_a_moved_key_is_handled_out_of_order() -> None:
    # Given the same straggler story with consumers that ignore the gate
    moving = next(k for k in KEYS if Layout(2).partition_for(k) != Layout(4).partition_for(k))
    world = World.create(2, 4, [[moving]], per_key=2)
    world.gate = False
    world.publish(0)
    world.request()
    while world.spec.epoch == 0:
        world.lead()
    world.refresh(0)
    world.publish(0)
    # When the new partition's consumer runs first
    world.consume(Layout(4).partition_for(moving))
    world.settle()
    # Then message 1 overtakes message 0: the gate is what keeps the order
    assert [m.seq for m in world.handled] == [1, 0]


def test_a_shrink_keeps_its_retired_partitions_served_until_they_drain() -> None:
    # Given a resize 12 -> 8, switched (the spec holds 8)
    state, _ = run(resize.begin(Layout(12), 8, running=None)[0], Declared(), Cut())
    state, _ = run(state, *(Fenced(p) for p in range(12)), Bound(), Switched())
    # Then the coordinator assigns the retired partitions 8-11 too, up to the highest
    # that has not drained, and only the spec's 8 once they all have
    assert resize.served(8, state) == 12
    state, _ = run(state, Drained(0, 11), Drained(0, 10))
    assert resize.served(8, state) == 10
    state, _ = run(state, Drained(0, 8), Drained(0, 9))
    assert resize.served(8, state) == 8
    # and before the switch (the spec still holds 12), or with no resize, the spec's count
    assert resize.served(12, resize.begin(Layout(12), 8, running=None)[0]) == 12
    assert resize.served(6, None) == 6


def test_a_shrinks_retired_partitions_are_given_up_by_the_consumers_drained_keys() -> None:
    # Given a resize 12 -> 8 (old epoch 0), switched, whose command returned without --wait
    # (the record never learns what drained)
    state, _ = run(resize.begin(Layout(12), 8, running=None)[0], Declared(), Cut())
    state, _ = run(state, *(Fenced(p) for p in range(12)), Bound(), Switched())
    # When the consumers record the fences of 9, 10 and 11 (and of another epoch's 8)
    drained = [(0, 9), (0, 10), (0, 11), (1, 8)]
    # Then the coordinator serves up to 8, the highest not drained: 9 partitions
    assert resize.served(8, state, drained) == 9
    # and once 8 drained too, only the spec's 8
    assert resize.served(8, state, [*drained, (0, 8)]) == 8


def test_the_summary_shows_the_phase_the_draining_and_the_gates() -> None:
    state, _ = run(resize.begin(Layout(6), 12, running=None)[0], Declared(), Cut())
    state, _ = run(state, Drained(0, 0), Drained(0, 1), Drained(0, 2))
    doc = resize.summary(state)
    assert doc["phase"] == "cut" and doc["draining"] == [3, 4, 5] and doc["retiring"] == []
    assert doc["waiting"] == {"9": [3], "10": [4], "11": [5]}
    lines = resize.summary_lines(doc, "s")
    assert lines[0] == "resize 6 -> 12 partitions (epoch 1): cut"
    assert "old partitions still draining (fence not handled): 3-5" in lines[1]
    assert lines[2].endswith("9 on 3; 10 on 4; 11 on 5")
    assert lines[-1].endswith("partq stream resize s --partitions 12 --wait")
    assert resize.ranges([5, 0, 1, 2, 7, 8]) == "0-2, 5, 7-8" and resize.ranges([]) == "-"
    retired = State(state.resize, Phase.RETIRED)
    assert resize.summary_lines(resize.summary(retired), "s") == []


def test_the_command_to_continue_a_resize_with_and_without_wait() -> None:
    # The CLI, the resizer's timeout, status and admin's refusals all print this one
    assert resize.command_line("s", 12, wait=True) == "partq stream resize s --partitions 12 --wait"
    assert resize.command_line("s", 12, wait=False) == "partq stream resize s --partitions 12"


def test_status_names_a_shrink_s_old_queues_as_retiring_not_as_beyond_the_spec() -> None:
    from partq.coordinator.ops.status import beyond_lines

    state, _ = run(resize.begin(Layout(12), 8, running=None)[0], Declared(), Cut())
    state, _ = run(state, *(Fenced(p) for p in range(12)), Bound(), Switched(), Drained(0, 8))
    beyond = [
        {"partition": p, "queue": f"partq.s.p{p:05d}", "messages": 3, "consumers": 1}
        for p in (8, 9, 12)
    ]
    report = {
        "stream": "s",
        "partitions": 8,
        "resize": resize.summary(state),
        "beyond_spec": beyond,
    }
    lines = beyond_lines(report)
    assert lines[0] == "resize 12 -> 8 partitions (epoch 1): switched"
    assert "queue partq.s.p00008 is retired by the resize: 3 messages, 1 consumers" in "".join(
        lines
    )
    assert "queues to delete once drained and empty: 8-11" in "".join(lines)
    # a queue beyond the old count too is not the resize's: reported as before
    assert lines[-1] == "queue partq.s.p00012 exists beyond the stream's 8 partitions: 3 messages"


def test_a_grow_is_served_from_its_declare_on() -> None:
    # Given a resize 6 -> 12 just requested (its queues not declared yet): the spec's 6
    requested = resize.begin(Layout(6), 12, running=None)[0]
    assert resize.served(6, requested) == 6 and resize.grown(requested) is None
    # When its queues are declared, then all 12 are assigned, before the switch and after
    declared, _ = run(requested, Declared())
    assert resize.served(6, declared) == 12 and resize.grown(declared) == 12
    state, _ = run(declared, Cut(), *(Fenced(p) for p in range(6)), Bound(), Switched())
    assert resize.served(12, state) == 12
    # And a shrink is never served early
    shrink, _ = run(resize.begin(Layout(12), 8, running=None)[0], Declared())
    assert resize.grown(shrink) is None and resize.served(12, shrink) == 12
