"""The etcd key layout: the only module that formats partq's etcd keys.

Which kind a stream's group key is, what its name means, how its value is decoded and
where it is mirrored: one row per kind in :data:`partq.coordinator.store.kinds.KINDS`.

Everything lives under ``/partq/v1/``; per stream::

    /partq/v1/streams/<stream>/spec                      the StreamSpec (JSON)
    /partq/v1/streams/<stream>/members/<member>          one per consumer, on its lease
    /partq/v1/streams/<stream>/leader/<lease hex>        election candidates, on their leases
    /partq/v1/streams/<stream>/assignment/<partition>    owner of one partition (leader-written)
    /partq/v1/streams/<stream>/claims/<partition>        "I am consuming it", on the owner's lease
    /partq/v1/streams/<stream>/standby/<partition>       the hot standby of a partition (leader)
    /partq/v1/streams/<stream>/requests/<name>           operator requests (manual mode)
    /partq/v1/streams/<stream>/resize                    a resize's record
    (partq.coordinator.leader.resize)
    /partq/v1/streams/<stream>/drained/<epoch>/<part>    old partition <part> handled the fence
                                                         of epoch <epoch> (docs/resize.md)

Partitions are zero-padded to 5 digits so keys sort numerically.

A stream's **groups** (docs/groups.md): the keys above are its default group's. Another
group ``G`` has the same kinds under ``/partq/v1/streams/<stream>~G/`` (its *scope*: no
stream or group name holds "~", so one group's keys are never under another's prefix and
a role's rights on one reach no other), except the spec and the resize record, which are
the stream's and read by every group. The groups a stream has::

    /partq/v1/streams/<stream>/groups/<group>            a group's record (JSON)

Apart from the stream's keys, so that no member's watch receives them::

    /partq/v1/load/<stream>/<member>                     what a member handled lately, per
                                                         partition, on its lease (read by the
                                                         leader and the status page)
    /partq/v1/policy/<stream>/<lease hex>                a coordinator's policy (its flags), on
                                                         its candidate's lease (read by
                                                         ``partq rebalance`` and ``pause``)
"""

from __future__ import annotations

ROOT = "/partq/v1"
STREAMS = f"{ROOT}/streams/"
GROUP_SEPARATOR = "~"


def stream_of(scope: str) -> str:
    """The stream a group's scope (``stream`` or ``stream~group``) belongs to."""
    return scope.partition(GROUP_SEPARATOR)[0]


def groups_of(stream: str) -> str:
    """The records of ``stream``'s groups other than its default one."""
    return f"{stream_prefix(stream)}groups/"


def group_record(stream: str, group: str) -> str:
    return f"{groups_of(stream)}{group}"


def group_scopes(stream: str) -> str:
    """The prefix of every key of every group of ``stream`` but its default one (``stream
    delete``; the admin's right)."""
    return f"{STREAMS}{stream}{GROUP_SEPARATOR}"


def stream_prefix(stream: str) -> str:
    return f"{STREAMS}{stream}/"


def spec(scope: str) -> str:
    """The stream's spec (every group of it reads the one)."""
    return f"{stream_prefix(stream_of(scope))}spec"


def members(stream: str) -> str:
    return f"{stream_prefix(stream)}members/"


def member(stream: str, member_id: str) -> str:
    return f"{members(stream)}{member_id}"


def leader_prefix(stream: str) -> str:
    return f"{stream_prefix(stream)}leader/"


def leader_candidate(stream: str, lease_id: int) -> str:
    return f"{leader_prefix(stream)}{lease_id:016x}"


def assignments(stream: str) -> str:
    return f"{stream_prefix(stream)}assignment/"


def assignment(stream: str, partition: int) -> str:
    return f"{assignments(stream)}{partition:05d}"


def claims(stream: str) -> str:
    return f"{stream_prefix(stream)}claims/"


def claim(stream: str, partition: int) -> str:
    return f"{claims(stream)}{partition:05d}"


def standbys(stream: str) -> str:
    return f"{stream_prefix(stream)}standby/"


def standby(stream: str, partition: int) -> str:
    return f"{standbys(stream)}{partition:05d}"


def resize(scope: str) -> str:
    """The stream's resize record (every group of it reads the one)."""
    return f"{stream_prefix(stream_of(scope))}resize"


def drained_all(stream: str) -> str:
    """Every epoch's drained keys (consumers may write them: ``partq.coordinator.ops.rights``)."""
    return f"{stream_prefix(stream)}drained/"


def drained_prefix(stream: str, epoch: int) -> str:
    """Where the consumers of epoch ``epoch``'s old partitions record their fences."""
    return f"{drained_all(stream)}{epoch}/"


def drained(stream: str, epoch: int, partition: int) -> str:
    return f"{drained_prefix(stream, epoch)}{partition:05d}"


def requests(stream: str) -> str:
    return f"{stream_prefix(stream)}requests/"


def request(stream: str, name: str) -> str:
    return f"{requests(stream)}{name}"


def parked_keys(stream: str) -> str:
    return f"{stream_prefix(stream)}parked/"


def parked(stream: str, key_id: str) -> str:
    """A parked message key's record; ``key_id`` from :func:`partq.producer.contract.key_id`."""
    return f"{parked_keys(stream)}{key_id}"


def stream_of_spec(key: str | bytes) -> str | None:
    """The stream name in a spec key, or None for any other key."""
    text = key.decode() if isinstance(key, bytes) else key
    if not text.startswith(STREAMS) or not text.endswith("/spec"):
        return None
    return text[len(STREAMS) : -len("/spec")]


def loads(stream: str) -> str:
    return f"{ROOT}/load/{stream}/"


def load(stream: str, member_id: str) -> str:
    return f"{loads(stream)}{member_id}"


def policies(stream: str) -> str:
    return f"{ROOT}/policy/{stream}/"


def policy(stream: str, lease_id: int) -> str:
    """The policy of the coordinator whose candidate key is on lease ``lease_id``."""
    return f"{policies(stream)}{lease_id:016x}"
