"""The class-data-sharing archive of the tests' Spark JVMs (made by ``make setup``).

    python tests/python/jvm_archive.py     # build/jvm/spark-tests-<venv's key>.jsa

A Spark JVM spends most of its start loading and verifying the same ~10,000
classes from pyspark's jars; the tests start about a hundred of them
(drivers, executors, standalone masters and workers, spark-submit's
launcher).  This script runs one local Spark session through the kinds of
work the tests do (SQL, an RDD job with Python workers, Arrow transfers,
barrier tasks) with ``-XX:ArchiveClassesAtExit``, so the JVM writes every
class it loaded into a dynamic CDS archive; ``conftest.py`` then hands
``-XX:SharedArchiveFile`` to every JVM the tests start, and a JVM whose class
path starts with pyspark's maps those classes instead of loading them (a
local session and a few jobs: about half the JVM's CPU time).  A JVM with
another class path (the mini Hadoop, Maven) cannot use the archive and runs
as it would without it; the JVM's own warning about that is switched off.

The archive is tied to this JDK and these jars: the JVM checks them and
ignores an archive that does not match, so a stale one costs time, never
correctness; ``make`` rebuilds it when the venv changes.
"""

from __future__ import annotations

import hashlib
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: JVM options for every JVM the tests start (conftest.py puts them in
#: JAVA_TOOL_OPTIONS).  Test JVMs live seconds to minutes, where the C2
#: compiler and the parallel collector's threads cost more CPU than they win
#: back: test_compat_tfos.py took 299 CPU s without these, 209 with them.
TEST_JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
#: Every Spark the tests start (its conf reads ``spark.*`` system properties)
#: runs its Python workers from ember.spark_daemon, which saves each worker
#: about 0.4 CPU s (docs/spark.md, "A job"); the suite starts about 300.
TEST_SPARK_DAEMON = "-Dspark.python.daemon.module=ember.spark_daemon"


def archive_path() -> str:
    """The archive for this interpreter's pyspark (each venv has its own
    jars, and an archive serves only the class path it was made with)."""
    import importlib.util

    spec = importlib.util.find_spec("pyspark")
    where = os.path.dirname(spec.origin) if spec and spec.origin else "none"
    key = hashlib.sha1(where.encode()).hexdigest()[:10]
    return os.path.join(REPO, "build", "jvm", f"spark-tests-{key}.jsa")


def jvm_options_for_tests() -> str:
    """TEST_JVM_OPTIONS and TEST_SPARK_DAEMON, and this venv's archive with
    the JVM's warnings about it off when it exists (a JVM that cannot use
    it, with another class path, runs as it would without it)."""
    archive = archive_path()
    if not os.path.exists(archive):
        return f"{TEST_JVM_OPTIONS} {TEST_SPARK_DAEMON}"
    return (f"{TEST_JVM_OPTIONS} {TEST_SPARK_DAEMON} -XX:SharedArchiveFile={archive} "
            "-Xlog:cds=off -Xlog:cds+dynamic=off")


def main(path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    partial = path + ".partial"  # renamed once the JVM has written it whole
    # the options the archive is used with, and only those (no archive in use)
    os.environ["JAVA_TOOL_OPTIONS"] = f"{TEST_JVM_OPTIONS} -XX:ArchiveClassesAtExit={partial}"
    os.environ["PYSPARK_PYTHON"] = sys.executable

    from pyspark import BarrierTaskContext, SparkContext
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    spark = (SparkSession.builder.master("local[2]").appName("ember-jvm-archive")
             .config("spark.ui.enabled", "false")
             .config("spark.driver.host", "127.0.0.1")
             .config("spark.driver.bindAddress", "127.0.0.1")
             .getOrCreate())
    try:
        sc = spark.sparkContext
        sc.setLogLevel("WARN")
        sc.parallelize(range(1000), 2).map(lambda x: x * 2).sum()

        def barrier(it):  # the nodes' launch stage
            BarrierTaskContext.get().barrier()
            return it

        sc.parallelize(range(2), 2).barrier().mapPartitions(barrier).collect()
        df = spark.createDataFrame([(i, float(i), [0.5] * 4) for i in range(2000)],
                                   "id long, x double, v array<float>").repartition(2)
        df.groupBy((F.col("id") % 7).alias("k")).agg(F.sum("x")).collect()
        df.mapInArrow(lambda batches: batches, df.schema).count()
        probe = os.path.join(os.path.dirname(os.path.abspath(path)), "probe.parquet")
        df.write.mode("overwrite").parquet(probe)
        spark.read.parquet(probe).count()
        df.rdd.map(lambda r: r.id).sum()
    finally:
        gateway = SparkContext._gateway
        spark.stop()
    # the JVM writes the archive as it exits, which it does when its stdin closes
    jvm = gateway.proc
    gateway.shutdown()
    jvm.stdin.close()
    if jvm.wait(300) != 0 or not os.path.exists(partial):
        raise SystemExit(f"the JVM exited {jvm.returncode} without writing {partial}")
    os.replace(partial, path)
    import shutil

    shutil.rmtree(probe, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else archive_path())
