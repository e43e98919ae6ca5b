"""Layouts and the key mapping of a resize (producer/layout.py): pure, no broker."""

from __future__ import annotations

import json
import math
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from partq.producer.contract import MAX_PARTITIONS, StreamSpec, partition_for
from partq.producer.layout import Layout, Resize, parse_routing_key

from partq.kernel.errors import UsageError

VECTORS = json.loads(
    (Path(__file__).resolve().parents[1] / "data" / "partition-vectors.json").read_text()
)["vectors"]

counts = st.integers(min_value=1, max_value=MAX_PARTITIONS)
small_counts = st.integers(min_value=1, max_value=64)
keys = st.one_of(st.text(max_size=40), st.binary(max_size=40))


def vector_key(vector: dict[str, object]) -> str | bytes:
    if "key" in vector:
        return str(vector["key"])
    return bytes.fromhex(str(vector["key_hex"]))


def resize(old: int, new: int) -> Resize:
    return Layout(old).resize(new)


def test_an_unresized_layout_is_the_contract_on_every_golden_vector() -> None:
    # Given the pinned vectors (every key, every P they list)
    checked = 0
    for vector in VECTORS:
        key = vector_key(vector)
        for p_text, expected in vector["partition"].items():
            layout = Layout(int(p_text))
            # Then epoch 0 puts the key where the contract does, with the contract's routing key
            assert layout.partition_for(key) == expected
            assert layout.routing_key(expected) == str(expected)
            checked += 1
    assert checked == 140


@settings(max_examples=200, deadline=None)
@given(keys, counts)
def test_an_unresized_layout_agrees_with_the_spec(key: str | bytes, partitions: int) -> None:
    spec = StreamSpec("s", partitions)
    assert Layout(partitions).partition_for(key) == spec.partition_for(key)


def test_later_epochs_keep_the_hash_and_stamp_the_routing_key() -> None:
    # Given the same count under epoch 3
    layout = Layout(16, epoch=3)
    # Then a key still hashes mod P, and its routing key names the epoch
    assert layout.partition_for("Alice") == 14 == partition_for("Alice", 16)
    assert layout.routing_key(14) == "3.14"
    assert parse_routing_key("3.14") == (3, 14)
    assert parse_routing_key("14") == (0, 14)
    with pytest.raises(ValueError, match=r"outside 0\.\.15 of epoch 3"):
        layout.routing_key(16)


@pytest.mark.parametrize(
    "text", ["", "a", "1.", ".1", "0.1", "01", "1.02", "1.2.3", "-1", "\u0661"]
)
def test_a_routing_key_not_in_its_one_spelling_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="not a partq routing key"):
        parse_routing_key(text)


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=10**6), counts, st.data())
def test_a_routing_key_reads_back(epoch: int, partitions: int, data: st.DataObject) -> None:
    layout = Layout(partitions, epoch)
    partition = data.draw(st.integers(min_value=0, max_value=partitions - 1))
    assert parse_routing_key(layout.routing_key(partition)) == (epoch, partition)


@pytest.mark.parametrize(
    ("current", "asked", "message"),
    [
        (12, 0, "--partitions 0 is out of range: give 1 to 65536"),
        (12, MAX_PARTITIONS + 1, "--partitions 65537 is out of range: give 1 to 65536"),
        (12, 12, "the stream already has 12 partitions: give another count"),
    ],
)
def test_a_bad_count_is_refused_in_one_line(current: int, asked: int, message: str) -> None:
    with pytest.raises(UsageError) as raised:
        Layout(current).resize(asked)
    assert str(raised.value) == message


def test_a_configured_maximum_bounds_the_count() -> None:
    with pytest.raises(UsageError, match="give 1 to 32"):
        Layout(12).resize(33, maximum=32)
    assert Layout(12).resize(32, maximum=32).new == Layout(32, 1)


def test_a_resize_goes_to_the_next_epoch() -> None:
    assert Layout(12, epoch=4).resize(24) == Resize(Layout(12, 4), Layout(24, 5))
    with pytest.raises(ValueError, match="next epoch"):
        Resize(Layout(12, 4), Layout(24, 6))


@settings(max_examples=300, deadline=None)
@given(keys, counts, counts)
def test_the_parents_of_a_key_s_new_partition_hold_it(key: str | bytes, old: int, new: int) -> None:
    if old == new:
        return
    change = resize(old, new)
    before, after = change.old.partition_for(key), change.new.partition_for(key)
    # Then the old partition of every key feeds its new one, and the gate names it
    assert before in change.parents(after)
    assert after in change.children(before)
    assert change.moves(key) == (before != after)
    assert change.gate(key) == (before if before != after else None)
    assert change.may_handle(key, drained=[before])
    assert change.may_handle(key, drained=[]) == (before == after)


@settings(max_examples=300, deadline=None)
@given(small_counts, small_counts)
def test_parents_are_exactly_the_pairs_some_hash_makes(old: int, new: int) -> None:
    # Given every residue of lcm(P, N): each is some 32-bit hash, as lcm <= 2**32
    if old == new:
        return
    change = resize(old, new)
    made = {(r % old, r % new) for r in range(math.lcm(old, new))}
    # Then the parent relation is exactly the (old, new) pairs hashes produce, no more
    listed = {(p, q) for q in range(new) for p in change.parents(q)}
    assert listed == made
    assert {(p, q) for p in range(old) for q in change.children(p)} == made
    # and the fraction that stays is the residues whose two partitions are equal
    stays = sum(1 for r in range(math.lcm(old, new)) if r % old == r % new)
    assert change.staying == Fraction(stays, math.lcm(old, new))
    # and a new partition waits on all its parents but itself
    for q in range(new):
        assert set(change.gated(q)) == set(change.parents(q)) - {q}


@settings(max_examples=200, deadline=None)
@given(keys, st.integers(min_value=1, max_value=MAX_PARTITIONS // 2))
def test_doubling_keeps_a_key_in_place_or_moves_it_by_p(key: str | bytes, old: int) -> None:
    change = resize(old, 2 * old)
    before, after = change.old.partition_for(key), change.new.partition_for(key)
    # Then a key stays in its queue or goes to p + P, whose one parent is p
    assert after in (before, before + old)
    assert change.parents(after) == (before,)
    # and a queue kept by the doubling waits on no other partition
    if after < old:
        assert change.gated(after) == ()


@settings(max_examples=200, deadline=None)
@given(counts, counts)
def test_queues_are_kept_added_or_retired(old: int, new: int) -> None:
    if old == new:
        return
    change = resize(old, new)
    every = [*change.kept, *change.added, *change.retired]
    assert sorted(every) == list(range(max(old, new)))
    assert (len(change.added) == 0) or (len(change.retired) == 0)
    assert len(change.kept) == min(old, new)


@pytest.mark.parametrize(
    ("old", "new", "moved", "parents"),
    [
        (12, 24, Fraction(1, 2), 1),
        (24, 16, Fraction(2, 3), 3),
        (6, 12, Fraction(1, 2), 1),
        (12, 17, Fraction(16, 17), 12),
        (12, 8, Fraction(2, 3), 3),
    ],
)
def test_the_documented_figures(old: int, new: int, moved: Fraction, parents: int) -> None:
    # The numbers docs/resize.md gives, and a sample of keys that agrees with them
    change = resize(old, new)
    assert 1 - change.staying == moved
    assert {len(change.parents(q)) for q in range(new)} == {parents}
    sample = [f"key-{i}" for i in range(20_000)]
    share = sum(change.moves(key) for key in sample) / len(sample)
    assert abs(share - float(moved)) < 0.02


def test_a_spec_with_an_epoch_is_version_2_and_reads_back() -> None:
    plain = StreamSpec("orders", 12)
    assert plain.version == 1 and "epoch" not in plain.to_json()
    resized = StreamSpec("orders", 24, epoch=1)
    assert resized.version == 2 and resized.layout == Layout(24, 1)
    assert StreamSpec.from_json(resized.to_json()) == resized
    assert StreamSpec.from_json(plain.to_json()) == plain
    with pytest.raises(UsageError, match="epoch"):
        StreamSpec("orders", 12, epoch=-1)
