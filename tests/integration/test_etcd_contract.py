"""The FakeEtcd contract on a real etcd: the tests of tests/unit/test_fake_etcd.py, run here
against the etcd the integration tests start, so the fake cannot drift from the real thing."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from partq.kernel.etcd import connect
from partq.kernel.settings import Settings
from tests.unit.test_fake_etcd import (
    prefix,
    test_a_prefix_watch_gets_every_change_in_order,
    test_a_read_at_a_revision_sees_the_key_as_it_was_then_until_compacted,
    test_a_watch_from_a_revision_replays_what_came_after_it,
    test_comparisons_on_create_mod_value_and_lease,
    test_create_if_absent_transaction,
    test_lease_keys_go_with_the_lease,
    test_prefix_reads_are_sorted_and_bounded,
    test_put_get_delete_and_revisions,
    test_watch_events_carry_the_lease,
    test_watch_once_returns_the_next_event_or_times_out,
)

pytestmark = [pytest.mark.integration]

__all__ = [
    "prefix",
    "test_a_prefix_watch_gets_every_change_in_order",
    "test_a_read_at_a_revision_sees_the_key_as_it_was_then_until_compacted",
    "test_a_watch_from_a_revision_replays_what_came_after_it",
    "test_comparisons_on_create_mod_value_and_lease",
    "test_create_if_absent_transaction",
    "test_lease_keys_go_with_the_lease",
    "test_prefix_reads_are_sorted_and_bounded",
    "test_put_get_delete_and_revisions",
    "test_watch_events_carry_the_lease",
    "test_watch_once_returns_the_next_event_or_times_out",
]


@pytest.fixture
def client(settings: Settings, prefix: str) -> Iterator[Any]:
    """A real etcd3 client, as partq connects; the test's keys are deleted afterwards."""
    real = connect(settings)
    yield real
    real.delete_prefix(prefix)
    real.close()
