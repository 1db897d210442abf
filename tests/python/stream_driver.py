"""A driver program of test_stream.py's driver-kill test: trains 2 nodes
(streamfuns.checkpointed_ids) on a file stream until every file is trained,
then writes ``<out>/driver-done``.

    python stream_driver.py <src dir> <out dir> <checkpoint location> [<slow micro-batch>]

A slow micro-batch's training steps take 0.5 s each instead of 0.05 s, so
that a test which kills this driver in its middle kills it there however
loaded the machine is.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [os.path.join(REPO, "python"), HERE]


def main() -> int:
    src, out, ckpt = sys.argv[1:4]
    slow = (int(sys.argv[4]), 0.5) if len(sys.argv) > 4 else (None, 0)
    from pyspark.sql import SparkSession

    import streamfuns
    from ember.spark import InputMode, run

    os.environ["PYSPARK_PYTHON"] = sys.executable
    spark = (SparkSession.builder.master("local[4]").appName("ember-stream-driver")
             .config("spark.driver.host", "127.0.0.1")
             .config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.executorEnv.PYTHONPATH", os.pathsep.join([REPO, HERE]))
             .getOrCreate())
    spark.sparkContext.setLogLevel("WARN")
    df = spark.readStream.schema("id long").option("maxFilesPerTrigger", 1).json(src)
    cluster = run(spark.sparkContext, streamfuns.checkpointed_ids,
                  {"out": out, "step": 0.05, "batch": 25, "every": 2, "slow": slow},
                  num_executors=2, input_mode=InputMode.SPARK, reservation_timeout=60,
                  heartbeat_timeout=4)
    try:
        query = cluster.train_stream(df, checkpoint_location=ckpt, feed_timeout=60)
        query.processAllAvailable()
    finally:
        cluster.shutdown(timeout=60)
        spark.stop()
    open(os.path.join(out, "driver-done"), "w").close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
