"""The randomized fault soak (``python -m benchmarks.chaos --seed N --duration S``).

It builds its own 3-node RabbitMQ cluster and 3-member etcd on loopback
(``tests.cluster``), creates a stream (12 quorum partitions by default), starts 2
coordinators and 4-6 consumers as ``partq`` processes recording every handling
(``tests.integration.groups.recorder``), publishes keyed sequences through the SDK (300
keys at about 1,000 msg/s: ``SequenceProducer``), and lets a seeded nemesis
(:mod:`.nemesis`) fire a fault every 5-15 s: kill -9, SIGTERM or SIGSTOP of a consumer,
kill of an etcd member or its leader, kill of a RabbitMQ node, ``partq move``,
``rebalance``, ``drain`` (then ``--cancel``), scaling up and down. Then the checker
(:mod:`.verdict`): lost, duplicates by cause, order violations raw and not explained by a
crash (``examples.audit.order_violations``), overlaps, stalls (a partition idle past
``--idle-limit`` while a message waited in it), the pause each kind of fault causes, and
the memory of every process over time (``/proc``), with every RabbitMQ node's own
breakdown and Ra WAL size (:mod:`.broker_memory`). Its nodes run with
``raft.wal_max_size_bytes`` = 64 MiB (``--wal-max-bytes``) so that their memory cycles
within minutes and anything else that grows shows. It prints a table, writes the results
as JSON (``--out``) and exits 1 if anything was lost, out of order without a crash to
explain it, handled by two processes at once, or left waiting in a stalled partition.

Every process it starts is stopped by PID at the end, on Ctrl-C and SIGTERM too. Not a
test by itself: ``tests/integration/test_chaos.py`` runs it for 3 minutes with seed 1.
"""
