"""The main job: Fashion-MNIST on an embedded local Spark, in both input modes.

    python -m examples.fashion_mnist.main [--epochs 5] [--modes spark,tensorflow]

On GPUs: ``--master spark://... --gpus-per-node 1 --conf
spark.executor.resource.gpu.amount=1 --conf
spark.executor.resource.gpu.discoveryScript=...`` gives each node its own
GPU, assigned by Spark (``run(gpus_per_node=)``).

1. Data setup: a Spark job converts Debian's Fashion-MNIST idx files to CSV and
   to TFRecords (60,000 train, 10,000 test).
2. InputMode.SPARK: ``ember.spark.run`` starts 2 nodes; ``cluster.train`` pushes
   the CSV records through Ember's C feed into a MultiWorkerMirroredStrategy
   custom training loop (tf_keras); the chief checkpoints and exports a
   SavedModel.
3. InputMode.TENSORFLOW: the same model; each worker reads its shard of the
   TFRecords itself.
3b. ``--modes stream`` (not run by default): the CSV files, once per epoch,
   as a Structured Streaming file source, ``--files-per-trigger`` files per
   micro-batch; ``cluster.train_stream`` feeds each micro-batch, exactly once,
   to the same model (``model.train_stream``).
4. After each, ``cluster.inference`` runs the SavedModel over the 10,000 test
   records, one prediction per record, and the job prints accuracy and
   ``RESULT demo mode=... accuracy=... train_records_per_s=... wall_s=...``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
from typing import Any, Tuple

import numpy as np

from ember.spark import InputMode, run

from . import data, model


def parse_args(argv: Any = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", dest="batch_size", type=int, default=64,
                   help="per-worker batch size")
    p.add_argument("--learning-rate", dest="learning_rate", type=float, default=1e-3)
    p.add_argument("--num-executors", dest="num_executors", type=int, default=2)
    p.add_argument("--partitions", type=int, default=8, help="partitions of the CSV data")
    p.add_argument("--modes", default="spark,tensorflow",
                   help="any of spark, tensorflow, stream")
    p.add_argument("--collective", choices=("ember", "mwms"), default="ember",
                   help="how the nodes average gradients: Ember's collective (the faster) "
                        "or TensorFlow's MultiWorkerMirroredStrategy")
    p.add_argument("--steps-per-call", dest="steps_per_call", type=int, default=0,
                   help="training steps per tf.function call (0: the model's STEPS_PER_CALL)")
    p.add_argument("--files-per-trigger", dest="files_per_trigger", type=int, default=8,
                   help="stream mode: CSV files per micro-batch (8: one epoch of --partitions)")
    p.add_argument("--threads", type=int, default=0,
                   help="TensorFlow intra/inter-op threads per node "
                        "(0 = cores / num-executors, so nodes do not oversubscribe)")
    p.add_argument("--work-dir", dest="work_dir", default="out/fashion_mnist")
    p.add_argument("--data-dir", dest="data_dir", default="",
                   help="where the CSV and TFRecord data go: a local directory (default "
                        "WORK_DIR/data) or an hdfs:// URL (the trainers read it through "
                        "Ember's WebHDFS client; a Kerberized grid works with a ticket or "
                        "the delegation tokens Spark hands its executors)")
    p.add_argument("--train-limit", dest="train_limit", type=int, default=0,
                   help="use only the first N training images (0 = all 60,000)")
    p.add_argument("--test-limit", dest="test_limit", type=int, default=0)
    p.add_argument("--require-accuracy", dest="require_accuracy", type=float, default=0.0,
                   help="exit non-zero if a mode's test accuracy is below this")
    p.add_argument("--remote", default="",
                   help="a Spark Connect server (sc://host:port): the job runs as a Connect "
                        "client, on DataFrames (modes spark and tensorflow)")
    p.add_argument("--master", default="",
                   help="Spark master (default: local[max(2, num-executors)])")
    p.add_argument("--gpus-per-node", dest="gpus_per_node", type=int, default=0,
                   help="GPUs Spark assigns to each node (needs executors with GPUs)")
    p.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                   help="a Spark setting (repeatable)")
    return p.parse_args(argv)


#: What setup_data wrote, in a local --data-dir: a later run with the same
#: limits and partitions reuses the files instead of converting them again.
DATA_MANIFEST = "written.json"


def setup_data(spark: Any, args: argparse.Namespace) -> Tuple[int, int]:
    """Converts the idx files to CSV and TFRecords with Spark; returns (train, test) sizes.
    (A Connect client writes the TFRecords only: its DataFrames come from the arrays.)
    A local --data-dir that an earlier run filled with the same limits and
    partitions (its DATA_MANIFEST says so) is used as it is."""
    wanted = {"train_limit": args.train_limit, "test_limit": args.test_limit,
              "partitions": args.partitions}
    manifest = "" if args.data_dir.startswith("hdfs://") else \
        os.path.join(args.data_dir, DATA_MANIFEST)
    if manifest and os.path.exists(manifest):
        with open(manifest) as f:
            written = json.load(f)
        if {k: written.get(k) for k in wanted} == wanted and (written.get("csv") or args.remote):
            print(f"data: {written['sizes'][0]} train / {written['sizes'][1]} test records "
                  f"under {args.data_dir}, written by an earlier run ({DATA_MANIFEST})",
                  flush=True)
            return written["sizes"][0], written["sizes"][1]
        os.remove(manifest)  # rewritten below, once the files are
    start = time.monotonic()
    sizes = []
    for split, limit in (("train", args.train_limit), ("test", args.test_limit)):
        images, labels = split_arrays(args, split)
        if not args.remote:
            data.to_csv(spark.sparkContext, images, labels,
                        os.path.join(args.data_dir, "csv", split), args.partitions)
        data.to_tfrecords(spark, images, labels, os.path.join(args.data_dir, "tfrecords", split),
                          args.partitions)
        sizes.append(len(labels))
    kinds = "TFRecords" if args.remote else "CSV and TFRecords"
    print(f"data: {sizes[0]} train / {sizes[1]} test records as {kinds} under "
          f"{args.data_dir} ({time.monotonic() - start:.1f} s)", flush=True)
    if manifest:
        with open(manifest, "w") as f:
            json.dump(dict(wanted, csv=not args.remote, sizes=sizes), f)
    return sizes[0], sizes[1]


def split_arrays(args: argparse.Namespace, split: str) -> Tuple[Any, Any]:
    images, labels = data.load_split(split)
    limit = args.train_limit if split == "train" else args.test_limit
    return (images[:limit], labels[:limit]) if limit else (images, labels)


def input_data(spark: Any, args: argparse.Namespace, split: str) -> Any:
    """A split to feed: the CSV files as an RDD of records on classic Spark;
    over Spark Connect (no RDDs) a DataFrame of (image array<float> in [0,1], label)."""
    if not args.remote:
        return csv_rdd(spark.sparkContext, args, split)
    images, labels = split_arrays(args, split)
    return data.to_dataframe(spark, images, labels, args.partitions).select("image", "label")


def csv_rdd(sc: Any, args: argparse.Namespace, split: str) -> Any:
    return sc.textFile(os.path.join(args.data_dir, "csv", split), args.partitions) \
        .mapPartitions(data.parse_csv_partition)


def stream_dataframe(sc: Any, args: argparse.Namespace) -> Any:
    """The training CSV files, once per epoch, as a streaming DataFrame of
    (image: 784 float32 pixels 0..255 as a tensor column, label long),
    ``--files-per-trigger`` files per micro-batch."""
    from pyspark.sql import SparkSession

    source = os.path.join(args.data_dir, "csv", "train")
    stream_dir = os.path.join(args.data_dir, "stream")
    shutil.rmtree(stream_dir, ignore_errors=True)
    os.makedirs(stream_dir)
    parts = sorted(f for f in os.listdir(source) if f.startswith("part-"))
    past = time.time() - 3600
    for epoch in range(args.epochs):
        for part in parts:  # a file stream takes every new name once: one per epoch
            copy = os.path.join(stream_dir, f"e{epoch}-{part}")
            shutil.copyfile(os.path.join(source, part), copy)
            # a file stream takes files oldest first: epoch by epoch (copies,
            # not links, which would share one time), not the same file
            # several times in one micro-batch
            os.utime(copy, (past + epoch, past + epoch))
    spark = SparkSession.builder.getOrCreate()
    lines = spark.readStream.option("maxFilesPerTrigger", args.files_per_trigger) \
        .text(stream_dir)
    # raw pixels, 0..255 (the trainer scales them), parsed by Arrow in the
    # Python workers straight into a tensor column, the feed's fastest
    # layout (Spark's cast(split(value, ',') AS array<float>), then
    # ember.tensors.pack, built an array object per row in the JVM: on the
    # simulated hosts the executors took 107 CPU s for the SPARK and stream
    # runs, 23 for a TENSORFLOW run, which parses nothing there)
    return data.csv_tensors(lines)


def evaluate(spark: Any, args: argparse.Namespace, n_test: int) -> float:
    """Distributed inference with the exported SavedModel; returns test accuracy."""
    cluster = run(_session(spark, args), model.infer, args, num_executors=args.num_executors,
                  input_mode=InputMode.SPARK, master_node=None,
                  gpus_per_node=args.gpus_per_node)
    try:
        if args.remote:
            results = [r.result for r in cluster.collect_inference(
                input_data(spark, args, "test"))]
        else:
            results = cluster.inference(input_data(spark, args, "test")).collect()
    finally:
        cluster.shutdown()
    if len(results) != n_test:
        raise RuntimeError(f"inference returned {len(results)} results for {n_test} records")
    pairs = np.asarray(results, dtype=np.int64).reshape(-1, 2)
    os.makedirs(args.work_dir, exist_ok=True)
    np.savetxt(os.path.join(args.out_dir, "predictions.csv"), pairs, fmt="%d",
               delimiter=",", header="label,prediction", comments="")
    return float(np.mean(pairs[:, 0] == pairs[:, 1]))


def _session(spark: Any, args: argparse.Namespace) -> Any:
    """What ember.spark.run takes: the SparkContext, or a Connect client's session."""
    return spark if args.remote else spark.sparkContext


def train_and_evaluate(spark: Any, args: argparse.Namespace, mode: str, n_train: int,
                       n_test: int) -> Tuple[float, float, float]:
    """Trains in one input mode, then evaluates; returns (accuracy, records/s, wall s)."""
    run_args = argparse.Namespace(**vars(args))
    run_args.out_dir = os.path.abspath(os.path.join(args.work_dir, mode))
    run_args.model_dir = os.path.join(run_args.out_dir, "model")
    run_args.export_dir = os.path.join(run_args.out_dir, "export")
    run_args.train_records = n_train
    shutil.rmtree(run_args.out_dir, ignore_errors=True)
    os.makedirs(run_args.out_dir)
    print(f"\n=== InputMode.{mode.upper()}: training {args.epochs} epoch(s) on "
          f"{args.num_executors} nodes", flush=True)
    start = time.monotonic()
    sc = _session(spark, args)
    if mode == "spark":
        cluster = run(sc, model.train_spark, run_args, num_executors=args.num_executors,
                      num_ps=0, tensorboard=False, input_mode=InputMode.SPARK,
                      gpus_per_node=args.gpus_per_node)
        try:
            cluster.train(input_data(spark, args, "train"), args.epochs)
        finally:
            cluster.shutdown()
        if not args.remote:  # MLflow, when tracked
            cluster.log_artifacts(run_args.export_dir, "model")
    elif mode == "stream":
        cluster = run(sc, model.train_stream, run_args, num_executors=args.num_executors,
                      input_mode=InputMode.SPARK, gpus_per_node=args.gpus_per_node)
        try:
            query = cluster.train_stream(
                stream_dataframe(sc, args), trigger={"availableNow": True},
                checkpoint_location=os.path.join(run_args.out_dir, "stream-checkpoint"))
            query.awaitTermination()  # availableNow: every file, then the query ends
        finally:
            cluster.shutdown()
    else:
        cluster = run(sc, model.train_tf, run_args, num_executors=args.num_executors,
                      num_ps=0, tensorboard=False, input_mode=InputMode.TENSORFLOW,
                      gpus_per_node=args.gpus_per_node)
        cluster.shutdown()
        if not args.remote:
            cluster.log_artifacts(run_args.export_dir, "model")
    train_secs = time.monotonic() - start
    print(f"=== inference on {n_test} test records", flush=True)
    accuracy = evaluate(spark, run_args, n_test)
    wall = time.monotonic() - start
    rate = n_train * args.epochs / train_secs
    print(f"mode={mode}: test accuracy {accuracy:.4f}, {rate:.0f} train records/s, "
          f"train {train_secs:.1f} s, wall {wall:.1f} s", flush=True)
    return accuracy, rate, wall


def main(argv: Any = None) -> int:
    args = parse_args(argv)
    # Ember logs through the standard logging module: its progress (cluster
    # ready, records fed, the nodes' reports) at INFO, other libraries at WARNING
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        level=logging.WARNING)
    logging.getLogger("ember").setLevel(logging.INFO)
    args.work_dir = os.path.abspath(args.work_dir)
    args.data_dir = args.data_dir or os.path.join(args.work_dir, "data")
    if args.data_dir.startswith("hdfs://") and "stream" in args.modes:
        raise SystemExit("--modes stream reads a local --data-dir (its file stream copies files)")
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.num_executors)
    args.intra_op_threads = args.inter_op_threads = threads
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

    if args.remote:
        if "stream" in args.modes:
            raise SystemExit("--remote runs the modes spark and tensorflow (the stream mode "
                             "uses classic Spark)")
        builder = SparkSession.builder.remote(args.remote)
    else:
        master = args.master or f"local[{max(2, args.num_executors)}]"
        builder = (SparkSession.builder.master(master)
                   .appName("ember-fashion-mnist")
                   .config("spark.driver.host", "127.0.0.1")
                   .config("spark.driver.bindAddress", "127.0.0.1")
                   .config("spark.ui.enabled", "false")
                   .config("spark.driver.memory", "2g"))
    for kv in args.conf:
        key, sep, value = kv.partition("=")
        if not sep:
            raise SystemExit(f"--conf {kv!r}: expected KEY=VALUE")
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    if not args.remote:
        spark.sparkContext.setLogLevel("WARN")
    results = []
    try:
        n_train, n_test = setup_data(spark, args)
        for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
            if mode not in ("spark", "tensorflow", "stream"):
                raise SystemExit(f"unknown mode {mode!r} (spark, tensorflow or stream)")
            results.append((mode,) + train_and_evaluate(spark, args, mode, n_train, n_test))
    finally:
        spark.stop()
    failed = False
    print()
    for mode, accuracy, rate, wall in results:
        print(f"RESULT demo mode={mode} accuracy={accuracy:.4f} "
              f"train_records_per_s={rate:.0f} wall_s={wall:.1f}", flush=True)
        failed |= accuracy < args.require_accuracy
    if failed:
        print(f"accuracy below the required {args.require_accuracy}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
