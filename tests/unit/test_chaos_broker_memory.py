"""The soak's reading of RabbitMQ's memory breakdown (benchmarks.chaos.broker_memory)."""

from __future__ import annotations

from benchmarks.chaos.broker_memory import BrokerSample, parse, summary

# What `rabbitmqctl eval` printed for two 3.10.8 nodes (shortened), one of them unreachable.
PRINTED = """[{partqc1@localhost,[{connection_readers,248472},
                     {connection_channels,2939824},
                     {quorum_ets,110873752},
                     {binary,50268136},
                     {strategy,rss},
                     {total,[{erlang,242703032},{rss,284880896},{allocated,237629440}]}]},
 {partqc2@localhost,{badrpc,nodedown}},
 {partqc3@localhost,[{quorum_ets,24472},
                     {strategy,rss},
                     {total,[{erlang,67835840},{rss,154214400},{allocated,45891584}]}]}]
"""


def test_every_answering_node_is_read_and_total_is_the_rss_figure() -> None:
    found = parse(PRINTED)
    assert sorted(found) == ["partqc1@localhost", "partqc3@localhost"]
    assert found["partqc1@localhost"]["quorum_ets"] == 110873752
    assert found["partqc1@localhost"]["connection_channels"] == 2939824
    assert found["partqc1@localhost"]["total"] == 284880896
    assert found["partqc3@localhost"]["total"] == 154214400


def test_nothing_printed_is_no_node() -> None:
    assert parse("") == {}


def test_the_summary_gives_first_max_last_in_mib_per_node() -> None:
    mib = 2**20
    samples = [
        BrokerSample(2.0, "n1", {"quorum_ets": 90 * mib}),
        BrokerSample(1.0, "n1", {"quorum_ets": 10 * mib}),
        BrokerSample(3.0, "n1", {"quorum_ets": 5 * mib}),
    ]
    ets = summary(samples)["n1"]["quorum_ets"]
    assert (ets["first"], ets["max"], ets["last"], ets["samples"]) == (10, 90, 5, 3)
