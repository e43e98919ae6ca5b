"""Stream specs in etcd: created once with a create-if-absent transaction, read by everyone."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from partq.producer.contract import (
    DEFAULT_GROUP,
    StreamSpec,
    group_scope,
    split_scope,
    validate_group_name,
)

from partq.kernel import keys
from partq.kernel.errors import MalformedValue, SpecMismatch, StreamNotFound, UsageError
from partq.kernel.etcd import EtcdClient, connect, etcd_errors
from partq.kernel.settings import Settings

__all__ = ["Registry", "read_resize_from_endpoints", "read_spec_from_endpoints"]

log = logging.getLogger("partq.producer")


@dataclass(frozen=True)
class Registry:
    """Reads and creates stream specs. Implements ``producer.SpecSource``."""

    client: EtcdClient
    where: str

    @classmethod
    def connect(cls, settings: Settings | None = None) -> Registry:
        settings = settings or Settings.load()
        return cls(connect(settings), settings.etcd_endpoints)

    def create(self, spec: StreamSpec) -> bool:
        """Store ``spec``; True if created, False if an identical spec was there already.

        A stored spec that differs raises :class:`SpecMismatch` naming both values.
        """
        key = keys.spec(spec.name)
        client = self.client
        with etcd_errors(self.where):
            created, responses = client.transaction(
                compare=[client.transactions.version(key) == 0],
                success=[client.transactions.put(key, spec.to_json())],
                failure=[client.transactions.get(key)],
            )
        if created:
            return True
        stored = StreamSpec.from_json(responses[0][0][0], key)
        if stored.partitions != spec.partitions:
            raise SpecMismatch(
                f"stream {spec.name!r} already exists with {stored.partitions} partitions, "
                f"not {spec.partitions}: use --partitions {stored.partitions}, or change the "
                f"count with `partq stream resize {spec.name} --partitions {spec.partitions}`"
            )
        if stored.queue_type != spec.queue_type:
            raise SpecMismatch(
                f"stream {spec.name!r} already exists with queue type {stored.queue_type}, "
                f"not {spec.queue_type}"
            )
        return False

    def read_spec(self, scope: str) -> StreamSpec:
        """The spec of the stream ``scope`` names, naming its group's queues
        (:func:`partq.producer.contract.group_scope`); :class:`StreamNotFound` if the stream
        or the group does not exist."""
        stream, group = split_scope(scope)
        with etcd_errors(self.where):
            value, _meta = self.client.get(keys.spec(stream))
        if value is None:
            raise StreamNotFound(
                f"stream {stream!r} does not exist in etcd at {self.where}: create it with "
                f"`partq stream create {stream} --partitions N`"
            )
        spec = StreamSpec.from_json(value, keys.spec(stream))  # MalformedValue naming the key
        if group != DEFAULT_GROUP and not self._has_group(stream, group):
            raise StreamNotFound(
                f"stream {stream!r} has no group {group!r}: create it with "
                f"`partq group create {stream} {group}`"
            )
        return spec.in_group(group)

    def _has_group(self, stream: str, group: str) -> bool:
        with etcd_errors(self.where):  # its own key: a group's roles may read only that one
            value, _meta = self.client.get(keys.group_record(stream, group))
        return value is not None

    def add_group(self, stream: str, group: str) -> bool:
        """Record ``group`` of ``stream`` (True), or find it recorded (False)."""
        key = keys.group_record(stream, validate_group_name(group))
        client = self.client
        with etcd_errors(self.where):
            created, _ = client.transaction(
                compare=[client.transactions.version(key) == 0],
                success=[client.transactions.put(key, json.dumps({"v": 1, "group": group}))],
                failure=[],
            )
        return bool(created)

    def list_groups(self, stream: str) -> list[str]:
        """``stream``'s groups other than its default one, by name."""
        prefix = keys.groups_of(stream)
        with etcd_errors(self.where):
            found = self.client.get_prefix(prefix)
            names = [meta.key.decode(errors="replace")[len(prefix) :] for _, meta in found]
        return sorted(n for n in names if _is_group_name(n))

    def remove_group(self, stream: str, group: str) -> None:
        """Delete ``group``'s record and every key of its scope (``partq group delete``; its
        load reports and policies are on leases)."""
        with etcd_errors(self.where):
            self.client.delete_prefix(keys.stream_prefix(group_scope(stream, group)))
            self.client.delete(keys.group_record(stream, group))

    def watch_spec(self, scope: str, on_spec: Callable[[StreamSpec | None], None]) -> int:
        """Call ``on_spec`` with each new value of the spec of the stream ``scope`` names
        (None: deleted), on the watch's thread; a value that does not parse is logged and
        skipped. The watch id."""
        key, group = keys.spec(scope), split_scope(scope)[1]

        def on_response(response: Any) -> None:
            if response is None or isinstance(response, Exception):
                log.warning("the watch of %s ended (%s): reading it on demand", key, response)
                return
            for event in response.events:
                if event.key.decode(errors="replace") != key:
                    continue
                if type(event).__name__ == "DeleteEvent":
                    on_spec(None)
                    continue
                try:
                    on_spec(StreamSpec.from_json(event.value, key).in_group(group))
                except (MalformedValue, UsageError) as e:
                    log.warning("%s", e)

        with etcd_errors(self.where):
            # the key alone, not a prefix: the producer role may read only this key
            watch_id: int = self.client.add_watch_callback(key, on_response)
        return watch_id

    def cancel_watch(self, watch_id: int) -> None:
        self.client.cancel_watch(watch_id)

    def read_resize(self, stream: str) -> bytes | None:
        """``stream``'s resize record as stored (``partq.coordinator.leader.resize.encode``),
        or None."""
        with etcd_errors(self.where):
            value, _meta = self.client.get(keys.resize(stream))
        return value

    def list_specs(self) -> list[StreamSpec]:
        """Every stream's spec: the keys under the streams read without their values (a
        stream's group keys can be many and large), then each spec by its key."""
        specs = []
        with etcd_errors(self.where):
            found = [meta.key for _, meta in self.client.get_prefix(keys.STREAMS, keys_only=True)]
            for key in found:
                if keys.stream_of_spec(key) is None:
                    continue
                value, _meta = self.client.get(key.decode(errors="replace"))
                if value is not None:  # deleted since
                    specs.append(StreamSpec.from_json(value, key.decode(errors="replace")))
        return sorted(specs, key=lambda s: s.name)

    def delete(self, stream: str) -> None:
        """Remove every key of ``stream`` and of its groups (used by tests and `partq stream
        delete`)."""
        with etcd_errors(self.where):
            self.client.delete_prefix(keys.stream_prefix(stream))
            self.client.delete_prefix(keys.group_scopes(stream))  # (loads: on leases)

    def close(self) -> None:
        self.client.close()


@contextmanager
def _short_lived(settings: Settings) -> Iterator[Registry]:
    """A registry on one connection to the etcd ``settings`` name, closed on leaving."""
    registry = Registry.connect(settings)
    try:
        yield registry
    finally:
        registry.close()


def _at(endpoints: str) -> Settings:
    """The settings for the etcd at ``endpoints``; empty: the usual settings
    (``PARTQ_ETCD_ENDPOINTS``, the ``PARTQ_CONFIG`` file, or the default)."""
    return Settings.load(etcd_endpoints=endpoints or None)


def read_spec_from_settings(stream: str, settings: Settings) -> StreamSpec:
    """Read ``stream``'s spec from the etcd ``settings`` name, with one short-lived connection."""
    with _short_lived(settings) as registry:
        return registry.read_spec(stream)


def read_resize_from_endpoints(stream: str, endpoints: str) -> bytes | None:
    """``stream``'s resize record as stored, or None, from the etcd at ``endpoints`` (empty:
    the usual settings), with one short-lived connection."""
    with _short_lived(_at(endpoints)) as registry:
        return registry.read_resize(stream)


def read_spec_from_endpoints(stream: str, endpoints: str) -> StreamSpec:
    """Read ``stream``'s spec from the etcd at ``endpoints`` (the Spark sink's default reader;
    empty ``endpoints``: the usual settings)."""
    return read_spec_from_settings(stream, _at(endpoints))


def _is_group_name(name: str) -> bool:
    try:
        validate_group_name(name)
    except UsageError:
        return False
    return True
