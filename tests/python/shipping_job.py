"""The driver of test_packaging's Spark shipping test, run as its own process
(one SparkContext per process; the test session holds another).

    python shipping_job.py ENV_ARCHIVE WORK_DIR

Starts a standalone cluster (conftest.Standalone: a Master and two Workers)
whose executors run ``./environment/bin/python`` from ENV_ARCHIVE, given
through ``spark.archives``; nothing else puts Ember on their path.  Runs a
plain task and a two-node Ember job fed from an RDD, and prints one JSON line
with what the executors reported."""

from __future__ import annotations

import json
import os
import sys

from pyspark import cloudpickle

import shipping_funs
from conftest import Standalone, read_json_files


def main(archive: str, work: str) -> None:
    cloudpickle.register_pickle_by_value(shipping_funs)
    os.environ["PYSPARK_PYTHON"] = "./environment/bin/python"
    from pyspark.sql import SparkSession

    from ember.spark import InputMode, run

    cluster = Standalone(work)
    cluster.start()
    spark = None
    try:
        spark = (SparkSession.builder.appName("ember-shipping").master(cluster.url)
                 .config("spark.driver.host", "127.0.0.1")
                 .config("spark.driver.bindAddress", "127.0.0.1")
                 .config("spark.ui.enabled", "false")
                 .config("spark.archives", f"{archive}#environment")
                 .config("spark.pyspark.python", "./environment/bin/python")
                 .config("spark.executor.memory", "768m")
                 .config("spark.executor.cores", "1")
                 .config("spark.cores.max", "2")
                 .getOrCreate())
        cluster.wait_executors(spark, 2)
        sc = spark.sparkContext
        tasks = (sc.parallelize(range(2), 2)
                 .map(lambda _: shipping_funs.where_ember_comes_from()).collect())
        out = os.path.join(work, "nodes")
        os.makedirs(out)
        job = run(sc, shipping_funs.count_and_report, {"out": out}, num_executors=2,
                  input_mode=InputMode.SPARK, reservation_timeout=120)
        try:
            fed = job.train(sc.parallelize([(i, [0.5] * 4) for i in range(1000)], 4))
        finally:
            job.shutdown(timeout=120)
        print(json.dumps({"tasks": tasks, "nodes": read_json_files(out), "fed": fed}))
    finally:
        if spark is not None:
            spark.stop()
        cluster.stop()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
