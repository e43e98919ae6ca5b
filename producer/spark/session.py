"""A SparkSession on loopback with this interpreter's Python: for the job, tests, benchmarks.

Call it from an entry point: it sets ``SPARK_LOCAL_IP`` and ``PYSPARK_PYTHON``
(when unset) because the JVM Spark launches reads them from the environment.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from partq.producer.spark.sink import register
from pyspark import SparkConf, SparkContext
from pyspark.java_gateway import launch_gateway
from pyspark.sql import SparkSession

__all__ = ["LOOPBACK", "loopback_session"]

LOOPBACK = "127.0.0.1"


def loopback_session(
    app_name: str,
    *,
    master: str | None = "local[2]",
    conf: Mapping[str, str] | None = None,
) -> SparkSession:
    """A session bound to 127.0.0.1, executors on ``sys.executable``, format ``partq`` registered.

    ``master=None`` keeps the master Spark was given (``spark-submit --master``).
    """
    os.environ.setdefault("SPARK_LOCAL_IP", LOOPBACK)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.appName(app_name)
    if master is not None:
        builder = builder.master(master)
    settings = {
        "spark.driver.host": LOOPBACK,
        "spark.driver.bindAddress": LOOPBACK,
        "spark.pyspark.python": os.environ["PYSPARK_PYTHON"],
        "spark.ui.showConsoleProgress": "false",  # progress is logged per batch instead
        # The AMQP URL is a sink option; keep its password out of plans and logs.
        "spark.redaction.string.regex": r"(?i)amqps?://[^@/\s]*@",
        **(conf or {}),
    }
    for key, value in settings.items():
        builder = builder.config(key, value)
    if "PYSPARK_GATEWAY_PORT" not in os.environ and SparkContext._gateway is None:
        # Spark's JVM in a session of its own: a signal to our process group (a terminal, a
        # supervisor) reaches only this process, which stops the query, then Spark, in order;
        # a JVM shut down by it first fails both halfway. The JVM still ends with us: it
        # exits when its stdin, a pipe from this process, closes.
        launch = SparkConf().setAll(list(settings.items())).setAppName(app_name)
        if master is not None:
            launch.setMaster(master)
        gateway = launch_gateway(launch, popen_kwargs={"start_new_session": True})  # type: ignore[no-untyped-call]
        SparkContext._ensure_initialized(gateway=gateway)
    spark = builder.getOrCreate()
    register(spark)
    return spark
