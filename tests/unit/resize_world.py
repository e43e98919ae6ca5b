"""A model of a stream's broker, etcd, producers, consumers and leader, for the property
tests of the resize protocol (tests/unit/test_resize.py). Every move is atomic and chosen
by the test, so Hypothesis explores interleavings: stragglers, early fences, crashes of the
leader between an action and the record of its result.

The model's rules are the broker's and the protocol's as docs/resize.md states them:
a publish is routed by its routing key at the moment it is made, or returned; a queue is
FIFO; a consumer handles its queue's head or, for a gated key, waits (head of line).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from partq.coordinator.leader import resize
from partq.coordinator.leader.resize import Action, Event, State
from partq.producer.layout import Layout, parse_routing_key

SEEN = ("returned", "gated", "passed a gated key", "lost result")


@dataclass(frozen=True)
class Message:
    key: str
    seq: int  # the key's n-th message from its producer
    epoch: int  # the layout it was published under


@dataclass(frozen=True)
class FenceMark:
    epoch: int


@dataclass
class Producer:
    known: Layout
    outbox: list[tuple[str, int]]
    returned_at: int | None = None  # the epoch of a returned publish: wait for a newer one


@dataclass
class World:
    old: int
    new: int
    spec: Layout
    producers: list[Producer]
    queues: dict[int, list[Message | FenceMark]] = field(default_factory=dict)
    bindings: set[str] = field(default_factory=set)
    record: str | None = None  # the resize record in etcd
    reports: set[int] = field(default_factory=set)  # consumers' drained records in etcd
    handled: list[Message] = field(default_factory=list)
    # retired queues the broker would not delete, with what they held then
    refused_deletes: list[tuple[int, list[Message | FenceMark]]] = field(default_factory=list)
    # the leader: its state in memory, its to-do list and the result it has not recorded
    state: State | None = None
    todo: list[Action] = field(default_factory=list)
    inbox: list[Event] = field(default_factory=list)
    gate: bool = True  # False: consumers ignore the gate (to show the gate matters)
    # how a consumer waits at a gate: its whole queue ("queue", head of line), or only the
    # gated key, handling other keys of its prefetch window past it ("key")
    hold: str = "queue"
    window: int = 4
    # what happened, for the tests' statistics: publishes returned, consumers that waited at
    # a gate (or went past one, holding by key), leader deaths that lost a result the broker had
    # already carried out
    seen: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SEEN, 0))

    @classmethod
    def create(cls, old: int, new: int, producers: Iterable[Iterable[str]], per_key: int) -> World:
        spec = Layout(old)
        world = cls(old, new, spec, [])
        for keys in producers:
            outbox = [(key, seq) for seq in range(per_key) for key in keys]
            world.producers.append(Producer(spec, outbox))
        world.queues = {p: [] for p in range(old)}
        world.bindings = {spec.routing_key(p) for p in range(old)}
        return world

    # -- the moves ---------------------------------------------------------------------------

    def request(self) -> None:
        """`partq stream resize`: write the record (refused while one runs)."""
        running = resize.decode(self.record) if self.record else None
        state, _ = resize.begin(self.spec, self.new, running)
        self.record = resize.encode(state)

    def publish(self, i: int) -> None:
        producer = self.producers[i % len(self.producers)]
        if not producer.outbox or producer.returned_at is not None:
            return
        key, seq = producer.outbox[0]
        layout = producer.known
        routing_key = layout.routing_key(layout.partition_for(key))
        if routing_key not in self.bindings:  # mandatory: basic.return
            producer.returned_at = layout.epoch
            self.seen["returned"] += 1
            return
        _, partition = parse_routing_key(routing_key)
        self.queues[partition].append(Message(key, seq, layout.epoch))
        producer.outbox.pop(0)

    def refresh(self, i: int) -> None:
        """A producer reads the layout from etcd (a frozen one does not, for a while)."""
        producer = self.producers[i % len(self.producers)]
        producer.known = self.spec
        if producer.returned_at is not None and self.spec.epoch > producer.returned_at:
            producer.returned_at = None  # re-route the returned message, in order

    def consume(self, i: int) -> None:
        partitions = sorted(self.queues)
        queue = self.queues[partitions[i % len(partitions)]]
        index = self._next(queue)
        if index is None:
            return
        item = queue.pop(index)
        if isinstance(item, FenceMark):
            self.reports.add(partitions[i % len(partitions)])
        else:
            self.handled.append(item)

    def _next(self, queue: list[Message | FenceMark]) -> int | None:
        """Where in ``queue`` the consumer takes its next item: the head, unless it is gated;
        holding by key, the first of the prefetch window whose key has nothing gated before
        it. A fence is taken only at the head: everything before it must be handled."""
        held: set[str] = set()
        for index, item in enumerate(queue[: self.window if self.hold == "key" else 1]):
            if isinstance(item, FenceMark):
                return None if held else index
            if item.key in held:
                continue
            if not self.gate or self._may_handle(item):
                self.seen["passed a gated key"] += bool(held)
                return index
            self.seen["gated"] += 1
            held.add(item.key)
        return None

    def _may_handle(self, message: Message) -> bool:
        if self.record is None:
            return True
        state = resize.decode(self.record)
        if not state.running or message.epoch != state.resize.new.epoch:
            return True
        return state.resize.may_handle(message.key, self.reports)

    def lead(self) -> None:
        """The leader's next move: take over, record a result, or carry out an action."""
        if self.state is None:
            if self.record is not None:
                self.state = resize.decode(self.record)
                self._apply(resize.Resumed())
            return
        if self.inbox:
            self._apply(self.inbox.pop(0))
        elif self.todo:
            self.inbox.append(self._carry_out(self.todo.pop(0)))

    def watch(self) -> None:
        """The leader's watch delivers one consumer's drained record."""
        if self.state is None:
            return
        for partition in sorted(self.reports - self.state.drained):
            self._apply(resize.Drained(self.state.resize.old.epoch, partition))
            return

    def retry(self) -> None:
        """The leader's timer: an idle leader does again what its phase still needs."""
        if self.state is not None and not self.todo and not self.inbox:
            self._apply(resize.Resumed())

    def crash(self) -> None:
        self.seen["lost result"] += len(self.inbox)
        self.state, self.todo, self.inbox = None, [], []

    # -- the leader's shell ------------------------------------------------------------------

    def _apply(self, event: Event) -> None:
        assert self.state is not None
        self.state, actions = resize.step(self.state, event)
        self.record = resize.encode(self.state)  # recorded before any action is carried out
        self.todo.extend(actions)

    def _carry_out(self, action: Action) -> Event:
        match action:
            case resize.Declare(partitions):
                for p in partitions:
                    self.queues.setdefault(p, [])
                return resize.Declared()
            case resize.Unbind(layout):
                self.bindings -= {layout.routing_key(p) for p in range(layout.partitions)}
                return resize.Cut()
            case resize.Fence(epoch, partition):
                self.queues[partition].append(FenceMark(epoch))
                return resize.Fenced(partition)
            case resize.Bind(layout):
                self.bindings |= {layout.routing_key(p) for p in range(layout.partitions)}
                return resize.Bound()
            case resize.Switch(old, new):
                if self.spec == old:
                    self.spec = new
                assert self.spec == new
                return resize.Switched()
            case resize.Delete(partition):
                if self.queues.get(partition):
                    self.refused_deletes.append((partition, list(self.queues[partition])))
                    return resize.NotEmpty(partition)
                self.queues.pop(partition, None)
                return resize.Deleted(partition)
        raise AssertionError(action)

    # -- running it out ----------------------------------------------------------------------

    def settle(self, rounds: int = 5_000) -> None:
        """Every actor moves in turn, no crash, until nothing changes (bounded)."""
        for _ in range(rounds):
            before = self.snapshot()
            self.lead()
            self.watch()
            self.retry()
            for i in range(len(self.producers)):
                self.refresh(i)
                self.publish(i)
            for i in range(len(self.queues)):
                self.consume(i)
            if self.snapshot() == before:
                return
        raise AssertionError("the world did not settle")

    def snapshot(self) -> object:
        return (
            self.record,
            len(self.handled),
            sorted(self.reports),
            [(len(p.outbox), p.returned_at, p.known) for p in self.producers],
            {p: len(q) for p, q in self.queues.items()},
            len(self.todo),
            len(self.inbox),
            self.state is None,
        )
