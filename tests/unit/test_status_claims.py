"""``partq status`` on claims not on their member's lease: what it says is what happens."""

from __future__ import annotations

from partq.coordinator.ops.status import malformed_lines, snapshot_status
from partq.coordinator.store import codec
from partq.coordinator.store.codec import Member
from partq.coordinator.store.session import Session
from partq.producer.contract import StreamSpec
from partq.producer.registry import Registry

from partq.kernel import keys
from tests.fakes.etcd import FakeEtcd


def test_status_says_a_lease_less_claim_is_ignored_and_deleted_not_that_it_expires() -> None:
    # Given a member b on its lease, and two claims in b's name: one on no lease, one on a lease no
    # member holds
    fake = FakeEtcd()
    registry = Registry(fake, "fake")
    registry.create(StreamSpec("orders", 4))
    b = Session(fake, "fake", ttl=5)
    fake.put(keys.member("orders", "b"), codec.encode_member(Member("b")), lease=b.lease)
    fake.put(keys.claim("orders", 1), '{"v": 1, "member": "b", "at": 1}')
    spare = fake.lease(30)
    fake.put(keys.claim("orders", 2), '{"v": 1, "member": "b", "at": 1}', lease=spare)
    # When the status is read (no RabbitMQ: depths from a source that has none)
    report = snapshot_status(registry, None, "orders", depths=lambda _spec: [])  # type: ignore[arg-type]
    text = "\n".join(malformed_lines(report))
    # Then partition 1 counts as unclaimed, and each claim is described as it is handled
    assert "1" not in report["claims"] and report["claims"]["2"] == "b"
    assert "forged claims (1): not on their member's lease" in text
    assert f"partition 1: names b (lease {b.id:x}) but is on no lease" in text
    assert "claims on a lease no live member holds (1)" in text
    assert f"partition 2: names b (lease {b.id:x}) but is on lease {spare.id:x}" in text
    assert "gone within" not in text
    b.close()
