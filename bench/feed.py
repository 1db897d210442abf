"""make bench-feed: Fashion-MNIST-shaped records from Spark into a trainer.

The same records (784 float32 pixels + an int64 label; the images are the real
Fashion-MNIST training images, repeated) go, in one process tree on local
Spark, through:

  ember_df   Ember's feed from a cached DataFrame (Arrow path, columnar batches),
             the image an array<float> column
  ember_tensor  the same, the image a tensor column (ember.tensors.pack: 784
             float32 packed in one binary value per row; the trainer gets the
             same (n, 784) float32 array)
  ember_rdd  Ember's feed from an RDD of (numpy image, label) records
  tfos       TensorFlowOnSpark 2.2.5's InputMode.SPARK feed: its own
             TFSparkNode.train() feeding function pushing every record into its
             multiprocessing.Manager queue, consumed by its TFNode.DataFeed
  memcpy     a plain copy of the same bytes (the physical limit here)
  spark_arrow  Spark's ceiling for the DataFrame path: the same cached
             DataFrame through a mapInArrow that only counts rows (what any
             consumer of Spark's Arrow export can reach at best); and
             spark_arrow_tensor, the same for the tensor-column DataFrame

Every consumer touches every batch (sums the pixels) and the sums are checked
against the expected total, so nothing is counted that was not delivered.  The
bare channel (C producer and consumer, no Spark) is timed by
build/bench/feed_channel when it is built.

TensorFlowOnSpark moves a few thousand records/s, so by default it is timed on
the first --tfos-records records of the same data (records/s is what is
compared); pass --tfos-records 1000000 for the full run.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, Optional

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "python")]

RECORD_BYTES = 784 * 4 + 8


def _images() -> np.ndarray:
    from examples.fashion_mnist import data

    images, _ = data.load_split("train")
    return images.reshape(len(images), 784)


def _gen_arrow(batches: Any) -> Any:
    """mapInArrow over spark.range: record i is training image i % 60000."""
    import pyarrow as pa

    images = _images()
    for b in batches:
        ids = b.column(0).to_numpy()
        x = (images[ids % len(images)].astype(np.float32) / 255.0).reshape(-1)
        offsets = pa.array(np.arange(0, len(ids) * 784 + 1, 784, dtype=np.int32))
        yield pa.RecordBatch.from_arrays(
            [pa.ListArray.from_arrays(offsets, pa.array(x)), pa.array(ids % 10)],
            names=["image", "label"])


def _source(spark: Any, n: int, partitions: int) -> Any:
    return (spark.range(0, n, numPartitions=partitions)
            .mapInArrow(_gen_arrow, "image array<float>, label long"))


def expected_sum(n: int) -> float:
    images = _images().astype(np.float64) / 255.0
    per_image = images.astype(np.float32).astype(np.float64).sum(axis=1)
    full, rest = divmod(n, len(images))
    return float(per_image.sum() * full + per_image[:rest].sum())


# ------------------------------------------------------------------ consumers

def ember_consumer(args: Dict[str, Any], ctx: Any) -> None:
    feed = ctx.get_data_feed()
    rows, total, t0 = 0, 0.0, None
    while not feed.should_stop():
        batch = feed.next_batch(args["batch"])
        if len(batch) == 0:
            break
        if t0 is None:
            t0 = time.monotonic()
        image = batch.columns[batch.names.index("image")] if "image" in batch.names \
            else batch.columns[0]
        total += float(np.asarray(image, dtype=np.float32).sum(dtype=np.float64))
        rows += len(batch)
    with open(args["out"], "w") as f:
        f.write(f"{rows} {total!r} {time.monotonic() - (t0 or time.monotonic())}\n")


def _tfos_consumer(addr: Any, authkey: bytes, batch: int, out: str) -> None:
    from tensorflowonspark import TFManager, TFNode

    mgr = TFManager.connect(addr, authkey)
    feed = TFNode.DataFeed(mgr, train_mode=True)
    rows, total, t0 = 0, 0.0, None
    while not feed.should_stop():
        records = feed.next_batch(batch)
        if not records:
            continue
        if t0 is None:
            t0 = time.monotonic()
        image = np.asarray([r[0] for r in records], dtype=np.float32)
        total += float(image.sum(dtype=np.float64))
        rows += len(records)
    with open(out, "w") as f:
        f.write(f"{rows} {total!r}\n")


# ------------------------------------------------------------------ runs

def run_ember(spark: Any, data: Any, n: int, batch: int, workdir: str) -> Dict[str, float]:
    from ember.spark import InputMode, run

    out = os.path.join(workdir, f"ember-{time.monotonic_ns()}.txt")
    cluster = run(spark.sparkContext, ember_consumer, {"batch": batch, "out": out},
                  num_executors=1, input_mode=InputMode.SPARK, reservation_timeout=120)
    try:
        t0 = time.monotonic()
        fed = cluster.train(data, 1)
        secs = time.monotonic() - t0
    finally:
        cluster.shutdown(timeout=600)
    rows, total, _ = open(out).read().split()
    return dict(rows=int(rows), fed=fed, sum=float(total), secs=secs)


def run_tfos(spark: Any, rdd: Any, batch: int, workdir: str) -> Dict[str, float]:
    import multiprocessing

    from tensorflowonspark import TFManager, TFSparkNode, util

    authkey = os.urandom(16)
    mgr = TFManager.start(authkey, ["input", "output", "error"], "remote")
    mgr.set("state", "running")
    addr = mgr.address
    # TFSparkNode.train finds "this executor's" manager by IP and the executor_id
    # file in the Python worker's working directory (the driver's, in local mode)
    with open("executor_id", "w") as f:
        f.write("0")
    info = [{"host": util.get_ip_address(), "executor_id": 0, "addr": addr, "authkey": authkey}]
    meta = {"server_addr": None}
    out = os.path.join(workdir, "tfos.txt")
    consumer = multiprocessing.get_context("spawn").Process(
        target=_tfos_consumer, args=(addr, authkey, batch, out), daemon=True)
    consumer.start()
    try:
        t0 = time.monotonic()
        fed = rdd.mapPartitions(TFSparkNode.train(info, meta, feed_timeout=3600)).collect()
        secs = time.monotonic() - t0
        mgr.get_queue("input").put(None)  # what TFCluster.shutdown sends: end of feed
        consumer.join(600)
    finally:
        if consumer.is_alive():
            consumer.kill()
        mgr.shutdown()
    rows, total = open(out).read().split()
    if any(fed):
        raise RuntimeError("TensorFlowOnSpark reported a terminated feed")
    return dict(rows=int(rows), sum=float(total), secs=secs)


def _count_rows(batches: Any) -> Any:
    import pyarrow as pa

    rows = 0
    for b in batches:
        rows += b.num_rows
    yield pa.RecordBatch.from_pydict({"rows": pa.array([rows], pa.int64())})


def run_spark_arrow(df: Any, n: int) -> Dict[str, float]:
    t0 = time.monotonic()
    rows = sum(r[0] for r in df.mapInArrow(_count_rows, "rows long").collect())
    secs = time.monotonic() - t0
    if rows != n:
        raise SystemExit(f"spark_arrow: counted {rows} rows, expected {n}")
    return dict(rows=rows, secs=secs)


def run_memcpy(n: int) -> Dict[str, float]:
    chunk = 1024
    src = np.random.default_rng(0).random((chunk, RECORD_BYTES // 4), dtype=np.float32)
    dst = np.empty_like(src)
    reps = max(1, n // chunk)
    np.copyto(dst, src)
    t0 = time.monotonic()
    for _ in range(reps):
        np.copyto(dst, src)
    secs = time.monotonic() - t0
    # copying one cache-resident chunk over and over would flatter memcpy: also
    # copy a buffer larger than any cache, and keep the slower of the two
    big = np.random.default_rng(1).random(64 << 20, dtype=np.float32)  # 256 MiB
    big_dst = np.empty_like(big)
    np.copyto(big_dst, big)
    t1 = time.monotonic()
    np.copyto(big_dst, big)
    big_gbps = big.nbytes / (time.monotonic() - t1) / 1e9
    gbps = min(reps * src.nbytes / secs / 1e9, big_gbps)
    return dict(rows=n, secs=n * RECORD_BYTES / (gbps * 1e9), gbps=gbps)


def run_channel() -> Dict[str, float]:
    exe = os.path.join(ROOT, "build", "bench", "feed_channel")
    if not os.path.exists(exe):
        return {}
    out = subprocess.run([exe], capture_output=True, text=True, timeout=900).stdout
    m = re.search(r"^CHANNEL (.*)$", out, re.M)
    return {k: float(v) for k, v in (kv.split("=") for kv in m.group(1).split())} if m else {}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=1_000_000)
    p.add_argument("--tfos-records", dest="tfos_records", type=int, default=100_000)
    p.add_argument("--partitions", type=int, default=16)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=2,
                   help="passes of each DataFrame path (alternating; the best counts)")
    a = p.parse_args()
    n, tn = a.records, min(a.tfos_records, a.records)

    from pyspark.sql import SparkSession

    from ember import tensors

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ["PYTHONPATH"] = os.pathsep.join([ROOT] +
                                               os.environ.get("PYTHONPATH", "").split(os.pathsep))
    workdir = tempfile.mkdtemp(prefix="ember-bench-feed-")
    os.chdir(workdir)
    spark = (SparkSession.builder.master("local[2]").appName("ember-bench-feed")
             .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.ui.enabled", "false").config("spark.driver.memory", "8g")
             .config("spark.sql.execution.arrow.maxRecordsPerBatch", "4096")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    try:
        print(f"bench-feed: {n} records of {RECORD_BYTES} bytes ({n * RECORD_BYTES / 1e9:.2f} GB), "
              f"{a.partitions} partitions, local[2], {os.cpu_count()} CPUs", flush=True)
        t0 = time.monotonic()
        df = _source(spark, n, a.partitions).cache()
        assert df.count() == n
        print(f"cached the DataFrame in {time.monotonic() - t0:.1f} s", flush=True)
        want = expected_sum(n)
        results: Dict[str, Dict[str, float]] = {}

        # Spark's own ceiling for each DataFrame path: the same cached DataFrame
        # handed to a Python mapInArrow that only counts rows (no feed, no
        # consumer).  The JVM's first pass over a layout runs before its JIT has
        # compiled the export (20-40% slower here), so Ember and the ceiling
        # alternate --repeats times and each keeps its best.
        results.update(best_of(a.repeats, {
            "ember_df": lambda: _checked("ember_df", run_ember(spark, df, n, a.batch, workdir),
                                         n, want),
            "spark_arrow": lambda: run_spark_arrow(df, n)}))

        def records(it: Any) -> Any:
            for row in it:
                yield (np.asarray(row[0], dtype=np.float32), row[1])

        results["ember_rdd"] = r = run_ember(spark, df.rdd.mapPartitions(records), n, a.batch,
                                             workdir)
        _check("ember_rdd", r, n, want)
        df.unpersist(blocking=True)

        # The same records with the pixels as a tensor column (784 float32 packed
        # in one binary value per row): Spark exports one copy per row, not one
        # write per pixel, and the trainer gets the same (n, 784) float32 array.
        t0 = time.monotonic()
        df = tensors.pack(_source(spark, n, a.partitions), {"image": (784,)}).cache()
        assert df.count() == n
        print(f"cached the tensor-column DataFrame in {time.monotonic() - t0:.1f} s", flush=True)
        results.update(best_of(a.repeats, {
            "ember_tensor": lambda: _checked("ember_tensor",
                                             run_ember(spark, df, n, a.batch, workdir), n, want),
            "spark_arrow_tensor": lambda: run_spark_arrow(df, n)}))
        df.unpersist(blocking=True)

        df_t = _source(spark, tn, a.partitions).cache()
        df_t.count()
        results["tfos"] = r = run_tfos(spark, df_t.rdd.mapPartitions(records), a.batch, workdir)
        _check("tfos", r, tn, expected_sum(tn) if tn != n else want)
        df_t.unpersist()
    finally:
        spark.stop()
    results["memcpy"] = run_memcpy(n)
    channel = run_channel()

    print(f"\n{'path':<20}{'records':>10}{'seconds':>10}{'records/s':>14}{'GB/s':>9}")
    for name, r in results.items():
        rps = r["rows"] / r["secs"]
        print(f"{name:<20}{int(r['rows']):>10}{r['secs']:>10.2f}{rps:>14,.0f}"
              f"{rps * RECORD_BYTES / 1e9:>9.3f}")
    for k, v in channel.items():
        print(f"{'channel':<20}{k} = {v:.3f}")
    rps = {k: r["rows"] / r["secs"] for k, r in results.items()}
    # ember_rps is Ember's feed from the tensor-column DataFrame (its fastest
    # layout for these records); the array<float> DataFrame's figures follow it
    ember = rps["ember_tensor"]
    print(f"RESULT feed ember_rps={ember:.0f} tfos_rps={rps['tfos']:.0f} "
          f"ratio_vs_tfos={ember / rps['tfos']:.1f} ember_gbps={ember * RECORD_BYTES / 1e9:.3f} "
          f"channel_gbps={channel.get('channel_gbps', float('nan')):.3f} "
          f"memcpy_gbps={results['memcpy']['gbps']:.3f} ember_layout=tensor "
          f"ember_array_rps={rps['ember_df']:.0f} "
          f"ratio_array_vs_tfos={rps['ember_df'] / rps['tfos']:.1f} "
          f"ember_rdd_rps={rps['ember_rdd']:.0f} "
          f"spark_arrow_tensor_rps={rps['spark_arrow_tensor']:.0f} "
          f"ember_vs_spark_arrow_tensor={ember / rps['spark_arrow_tensor']:.2f} "
          f"spark_arrow_rps={rps['spark_arrow']:.0f} "
          f"ember_array_vs_spark_arrow={rps['ember_df'] / rps['spark_arrow']:.2f}")
    return 0


def best_of(repeats: int, runs: Dict[str, Any]) -> Dict[str, Dict[str, float]]:
    """Runs each of ``runs`` ``repeats`` times, alternating; keeps each one's fastest."""
    best: Dict[str, Dict[str, float]] = {}
    for _ in range(max(1, repeats)):
        for name, fn in runs.items():
            r = fn()
            print(f"  {name}: {r['rows'] / r['secs']:,.0f} records/s", flush=True)
            if name not in best or r["secs"] < best[name]["secs"]:
                best[name] = r
    return best


def _checked(name: str, r: Dict[str, float], n: int, want: float) -> Dict[str, float]:
    _check(name, r, n, want)
    return r


def _check(name: str, r: Dict[str, float], n: int, want: float) -> None:
    if r["rows"] != n or abs(r["sum"] - want) > 1e-6 * max(1.0, abs(want)):
        raise SystemExit(f"{name}: consumer got {r['rows']} records summing to {r['sum']}, "
                         f"expected {n} summing to {want}")


if __name__ == "__main__":
    sys.exit(main())
