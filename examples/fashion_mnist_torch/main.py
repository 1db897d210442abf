"""Fashion-MNIST with PyTorch on an embedded local Spark, through ember.spark.run.

    python -m examples.fashion_mnist_torch.main [--epochs 3] [--modes spark,tensorflow]

1. Data setup: a Spark job converts Debian's Fashion-MNIST idx files to CSV.
2. InputMode.SPARK: ``ember.spark.run`` starts 2 nodes; ``cluster.train`` pushes
   the CSV records through Ember's feed; each node trains the same PyTorch MLP
   on what it receives under DistributedDataParallel (``--strategy ddp``: gloo
   set up from the cluster spec; ``ddp-ember``: DDP's gradient allreduce on
   Ember's collective; ``ember``: no torch.distributed, an optimizer wrapper
   averages the gradients on Ember); rank 0 saves the model.
3. InputMode.TENSORFLOW: the same, each node reading its own shard of the idx
   files.
4. After each, ``cluster.inference`` runs the saved model over the 10,000 test
   records (one prediction per record) and the job prints
   ``RESULT torch mode=... accuracy=... wall_s=...``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from typing import Any, List, Tuple

import numpy as np

from ember.spark import InputMode, run
from examples.fashion_mnist import data

from . import model


def parse_args(argv: Any = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", dest="batch_size", type=int, default=64,
                   help="per-node batch size")
    p.add_argument("--learning-rate", dest="learning_rate", type=float, default=1e-3)
    p.add_argument("--num-executors", dest="num_executors", type=int, default=2)
    p.add_argument("--partitions", type=int, default=4, help="partitions of the CSV data")
    p.add_argument("--modes", default="spark,tensorflow")
    p.add_argument("--threads", type=int, default=1, help="torch threads per node")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--strategy", choices=("ddp", "ddp-ember", "ember"), default="ddp",
                   help="DDP over gloo, DDP with Ember's comm hook, or Ember's optimizer wrapper")
    p.add_argument("--work-dir", dest="work_dir", default="out/fashion_mnist_torch")
    p.add_argument("--train-limit", dest="train_limit", type=int, default=0,
                   help="use only the first N training images (0 = all 60,000)")
    p.add_argument("--require-accuracy", dest="require_accuracy", type=float, default=0.0,
                   help="exit non-zero if a mode's test accuracy is below this")
    return p.parse_args(argv)


def setup_data(sc: Any, args: argparse.Namespace) -> Tuple[int, int]:
    """Writes the train and test splits as CSV with Spark; returns their sizes."""
    sizes = []
    for split, limit in (("train", args.train_limit), ("test", 0)):
        images, labels = data.load_split(split)
        if limit:
            images, labels = images[:limit], labels[:limit]
        sizes.append(data.to_csv(sc, images, labels, os.path.join(args.data_dir, split),
                                 args.partitions))
    return sizes[0], sizes[1]


def csv_rdd(sc: Any, args: argparse.Namespace, split: str) -> Any:
    return sc.textFile(os.path.join(args.data_dir, split), args.partitions) \
        .mapPartitions(data.parse_csv_partition)


def train_and_evaluate(sc: Any, args: argparse.Namespace, mode: str) -> Tuple[float, float]:
    """Trains in one input mode, then infers the test set; returns (accuracy, wall s)."""
    run_args = argparse.Namespace(**vars(args))
    run_args.input_mode = mode
    run_args.out_dir = os.path.join(args.work_dir, mode)
    shutil.rmtree(run_args.out_dir, ignore_errors=True)
    start = time.monotonic()
    print(f"\n=== InputMode.{mode.upper()}: {args.epochs} epoch(s) on {args.num_executors} "
          "nodes", flush=True)
    if mode == "spark":
        cluster = run(sc, model.train, run_args, num_executors=args.num_executors,
                      input_mode=InputMode.SPARK)
        try:
            cluster.train(csv_rdd(sc, args, "train"), args.epochs)
        finally:
            cluster.shutdown()
    else:
        cluster = run(sc, model.train, run_args, num_executors=args.num_executors,
                      input_mode=InputMode.TENSORFLOW)
        cluster.shutdown()
    cluster = run(sc, model.infer, run_args, num_executors=args.num_executors,
                  input_mode=InputMode.SPARK, master_node=None)
    try:
        pairs = np.asarray(cluster.inference(csv_rdd(sc, args, "test")).collect(),
                           dtype=np.int64).reshape(-1, 2)
    finally:
        cluster.shutdown()
    if len(pairs) != args.n_test:
        raise RuntimeError(f"inference returned {len(pairs)} results for {args.n_test} records")
    accuracy = float(np.mean(pairs[:, 0] == pairs[:, 1]))
    wall = time.monotonic() - start
    print(f"mode={mode}: test accuracy {accuracy:.4f}, wall {wall:.1f} s", flush=True)
    return accuracy, wall


def main(argv: Any = None, sc: Any = None) -> List[Tuple[str, float, float]]:
    """Runs the job; with ``sc`` given, on that SparkContext (tests)."""
    args = parse_args(argv)
    args.work_dir = os.path.abspath(args.work_dir)
    args.data_dir = os.path.join(args.work_dir, "data")
    spark = None
    if sc is None:
        from pyspark.sql import SparkSession

        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        spark = (SparkSession.builder.master(f"local[{max(2, args.num_executors)}]")
                 .appName("ember-fashion-mnist-torch")
                 .config("spark.driver.host", "127.0.0.1")
                 .config("spark.driver.bindAddress", "127.0.0.1")
                 .config("spark.ui.enabled", "false")
                 .getOrCreate())
        spark.sparkContext.setLogLevel("WARN")
        sc = spark.sparkContext
    results = []
    try:
        n_train, args.n_test = setup_data(sc, args)
        print(f"data: {n_train} train / {args.n_test} test records as CSV", flush=True)
        for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
            if mode not in ("spark", "tensorflow"):
                raise SystemExit(f"unknown mode {mode!r} (spark or tensorflow)")
            results.append((mode,) + train_and_evaluate(sc, args, mode))
    finally:
        if spark is not None:
            spark.stop()
    print()
    for mode, accuracy, wall in results:
        print(f"RESULT torch mode={mode} accuracy={accuracy:.4f} wall_s={wall:.1f}", flush=True)
    return results


def _cli() -> int:
    args = parse_args()
    results = main()
    low = [m for m, acc, _ in results if acc < args.require_accuracy]
    if low:
        print(f"accuracy below the required {args.require_accuracy} in: {', '.join(low)}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_cli())
