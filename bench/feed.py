"""make bench-feed: Fashion-MNIST-shaped records from Spark into a trainer.

The same records (784 float32 pixels + an int64 label; the images are the real
Fashion-MNIST training images, repeated) go, in one process tree on local[2]
Spark with one trainer node, through three like-for-like comparisons, each
peer on the same cached data, the same partitions and the same record count:

  DataFrame, image an array<float> column
    ember_df      Ember's feed from the cached DataFrame (Arrow path)
    spark_arrow   Spark's ceiling for that path: the same DataFrame through a
                  mapInArrow that only counts rows
  DataFrame, image a tensor column (ember.tensors.pack: 784 float32 in one
  binary value per row; the trainer gets the same (n, 784) float32 array)
    ember_tensor, spark_arrow_tensor   as above
  RDD of (numpy float32[784] image, int label) records, cached
    ember_rdd     Ember's feed from the RDD (what TensorFlowOnSpark programs use)
    spark_rdd     Spark's ceiling for that path: the same RDD, grouped as the
                  feed groups it (one task per fed node), through a
                  mapPartitions that only iterates and counts
    tfos          TensorFlowOnSpark 2.2.5's InputMode.SPARK feed in its best
                  configuration: its own TFSparkNode.train() pushing every record
                  into the node's multiprocessing.Manager queue, the manager in
                  'local' mode (as TFoS's own nodes start it) and one feeding
                  task per node, consumed by its TFNode.DataFeed; in a
                  comparison of its own with Ember's feed after the ceiling's
                  (ember_rdd_beside_tfos; see main)

Each comparison first runs each side three times, not counted (warm-ups:
the JVM compiles each side's path over its first runs; TensorFlowOnSpark,
whose rounds are long and whose JVM path is spark_rdd's, excepted), and
each side's tasks run in Python workers of its own, then it runs
--rounds interleaved rounds (every side once per round,
the order rotated from round to round so that no side always goes first:
bench/rounds.py) and reports every side's median and [min-max]; records/s
and GB/s (1e9 bytes/s of record payload, 3,144 bytes a record).  Every
consumer touches every batch (sums the pixels) and the sums are checked
against the expected total, so nothing is counted that was not delivered.
memcpy of the same bytes and the bare C channel (build/bench/feed_channel)
are printed as references.

The RESULT line's headline ratios are the like-for-like ones:
rdd_vs_spark_rdd (goal >= 0.8), rdd_vs_tfos (goal >= 50),
tensor_vs_spark_arrow_tensor and df_vs_spark_arrow, each a ratio of medians.

Sizes: 1,000,000 DataFrame records and 200,000 RDD records by default.  The
RDD comparison needs about a second of Ember's feed per round: a Spark job
costs about 0.15 s to start and finish on local[2] whatever it does, on both
sides, and at 100,000 records that alone is a quarter of a round.

EMBER_BENCH_QUICK=1 (make bench-smoke) only makes the defaults tiny: 20,000
DataFrame records and 2,000 RDD records, 4 partitions; the
build/bench/feed_channel run it starts gets the same variable and moves 32,768
records.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional

import numpy as np

# bench/rounds.py (bench/ is this script's path); "rounds" is main()'s count
import rounds as rnd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "python")]

RECORD_BYTES = 784 * 4 + 8
QUICK = os.environ.get("EMBER_BENCH_QUICK", "") not in ("", "0")


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

def checksum(image: Any) -> float:
    """The sum of every value of a batch of images (records x 784 float32):
    float32 sums per record (numpy's pairwise SIMD sum), added up in float64.
    Every byte is still checked, at under half the CPU of one float64 sum
    over the batch, which on 2 cores competes with the feed it checks."""
    return float(image.reshape(len(image), -1).sum(axis=1).sum(dtype=np.float64))


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
        total += checksum(np.asarray(image, dtype=np.float32))
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
        total += checksum(image)
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
    # 'local': a Unix socket on this host, as TFoS's own nodes start it for
    # InputMode.SPARK (TFSparkNode.run: mode 'local' unless a PS or driver feeds)
    mgr = TFManager.start(authkey, ["input", "output", "error"], "local")
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


def _count_records(it: Any) -> Any:
    yield sum(1 for _ in it)


def run_spark_rdd(rdd: Any, n: int) -> Dict[str, float]:
    """Spark's ceiling for the RDD path: the records, one task per fed node as
    the feed groups them, iterated and counted in Python."""
    t0 = time.monotonic()
    rows = sum(rdd.coalesce(1).mapPartitions(_count_records).collect())
    secs = time.monotonic() - t0
    if rows != n:
        raise SystemExit(f"spark_rdd: counted {rows} records, expected {n}")
    return dict(rows=rows, secs=secs)


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
    p.add_argument("--records", type=int, default=20_000 if QUICK else 1_000_000,
                   help="records of the DataFrame comparisons")
    p.add_argument("--rdd-records", dest="rdd_records", type=int,
                   default=2_000 if QUICK else 200_000,
                   help="records of the RDD comparison: about 1 s of Ember's feed, so that "
                        "a Spark job's own start and end (about 0.15 s on either side) do not "
                        "drown the throughput compared (TensorFlowOnSpark's feed moves a few "
                        "thousand records/s: about 50-70 s a round)")
    p.add_argument("--partitions", type=int, default=4 if QUICK else 16)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=1 if QUICK else 3,
                   help="interleaved rounds of each comparison (at least 3)")
    a = p.parse_args()
    # at least 3 rounds for figures; the tiny smoke run (make bench-smoke) only
    # checks that every side still runs and reports
    n, rn, rounds = a.records, a.rdd_records, a.rounds if QUICK else max(3, a.rounds)

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
    load = os.getloadavg()[0]
    results: Dict[str, List[Dict[str, float]]] = {}
    try:
        print(f"bench-feed: {n} DataFrame records and {rn} RDD records of {RECORD_BYTES} bytes, "
              f"{a.partitions} partitions, local[2], {os.cpu_count()} CPUs, one trainer node, "
              f"{rounds} interleaved rounds, load {load:.1f}", flush=True)
        want = expected_sum(n)

        df = _source(spark, n, a.partitions).cache()
        assert df.count() == n
        results.update(_compare(rounds, {
            "ember_df": lambda: _checked("ember_df", run_ember(spark, df, n, a.batch, workdir),
                                         n, want),
            "spark_arrow": lambda: run_spark_arrow(df, n)}))
        df.unpersist(blocking=True)

        df = tensors.pack(_source(spark, n, a.partitions), {"image": (784,)}).cache()
        assert df.count() == n
        results.update(_compare(rounds, {
            "ember_tensor": lambda: _checked("ember_tensor",
                                             run_ember(spark, df, n, a.batch, workdir), n, want),
            "spark_arrow_tensor": lambda: run_spark_arrow(df, n)}))
        df.unpersist(blocking=True)

        def records(it: Any) -> Any:
            for row in it:
                yield (np.asarray(row[0], dtype=np.float32), row[1])

        # the records themselves are cached, so every side reads the same
        # (image, label) objects and none pays for making them
        rdd = _source(spark, rn, a.partitions).rdd.mapPartitions(records).cache()
        assert rdd.count() == rn
        rwant = expected_sum(rn)
        def ember_rdd() -> Dict[str, float]:
            return _checked("ember_rdd", run_ember(spark, rdd, rn, a.batch, workdir), rn, rwant)

        results.update(_compare(rounds, {"ember_rdd": ember_rdd,
                                         "spark_rdd": lambda: run_spark_rdd(rdd, rn)}))
        # TensorFlowOnSpark in a comparison of its own, after the ceiling's:
        # one of its rounds (about 65 s of the JVM feeding one record at a
        # time through the ceiling's own path, coalesce(1)) slowed the JVM
        # side of whatever ran after it.  With the three sides interleaved,
        # spark_rdd ran 171,875-196,407 records/s before TensorFlowOnSpark's
        # first round and 110,091-116,970 after (2026-11-28).  It gets no
        # warm-up: Ember's side is warm by now, and one TensorFlowOnSpark
        # round is a minute of a Python loop per record.
        print("  TensorFlowOnSpark's comparison (Ember's rounds: ember_rdd_beside_tfos):",
              flush=True)
        beside = _compare(rounds, {}, unwarmed={
            "ember_rdd": ember_rdd,  # the name keeps its Python workers (_own_workers)
            "tfos": lambda: _checked("tfos", run_tfos(spark, rdd.coalesce(1), a.batch, workdir),
                                     rn, rwant)})
        results["ember_rdd_beside_tfos"], results["tfos"] = beside["ember_rdd"], beside["tfos"]
        rdd.unpersist()
    finally:
        spark.stop()
        os.chdir(ROOT)
        shutil.rmtree(workdir, ignore_errors=True)
    results["memcpy"] = [run_memcpy(n) for _ in range(rounds)]
    channel = run_channel()

    rps = {k: [r["rows"] / r["secs"] for r in rs] for k, rs in results.items()}
    med = {k: rnd.spread(v).median for k, v in rps.items()}
    print(f"\n{'path':<22}{'records':>10}{'rounds':>7}{'median records/s':>18}"
          f"{'[min - max]':>24}{'median GB/s':>13}")
    for name, v in rps.items():
        print(f"{name:<22}{int(results[name][0]['rows']):>10}{len(v):>7}{med[name]:>18,.0f}"
              f"{rnd.fmt_range(v, ',.0f', ' - '):>24}{gbps(med[name]):>13.3f}")
    for k, v in channel.items():
        print(f"{'channel':<22}{k} = {v:.3f}")
    print("GB/s = 1e9 bytes/s of record payload; ratios are ratios of medians")
    print(f"RESULT feed rdd_vs_spark_rdd={med['ember_rdd'] / med['spark_rdd']:.2f} "
          f"rdd_vs_tfos={med['ember_rdd_beside_tfos'] / med['tfos']:.1f} "
          f"tensor_vs_spark_arrow_tensor={med['ember_tensor'] / med['spark_arrow_tensor']:.2f} "
          f"df_vs_spark_arrow={med['ember_df'] / med['spark_arrow']:.2f} "
          + " ".join(f"{k}_gbps={gbps(med[k]):.3f}" for k in
                     ("ember_rdd", "spark_rdd", "tfos", "ember_tensor", "spark_arrow_tensor",
                      "ember_df", "spark_arrow", "memcpy"))
          + f" ember_rdd_rps={med['ember_rdd']:.0f} "
          f"ember_rdd_beside_tfos_rps={med['ember_rdd_beside_tfos']:.0f} "
          f"tfos_rps={med['tfos']:.0f} "
          f"channel_gbps={channel.get('channel_gbps', float('nan')):.3f} "
          f"df_records={n} rdd_records={rn} rounds={rounds} load={load:.1f}")
    return 0


def gbps(records_per_s: float) -> float:
    return records_per_s * RECORD_BYTES / 1e9


Run = Callable[[], Dict[str, float]]


def _compare(rounds: int, sides: Dict[str, Run],
             unwarmed: Optional[Dict[str, Run]] = None) -> Dict[str, List[Dict[str, float]]]:
    """One comparison: warm-up runs of each of ``sides`` (:func:`_warm_up`),
    then ``rounds`` interleaved rounds of them and of ``unwarmed``, each side
    in Python workers of its own (:func:`_own_workers`)."""
    sides = {name: _own_workers(name, run) for name, run in sides.items()}
    _warm_up(sides)
    return rnd.interleaved(rounds, report=_report, sides={
        **sides, **{name: _own_workers(name, run) for name, run in (unwarmed or {}).items()}})


#: Set to the side's name while it runs (see _own_workers).
WORKER_POOL_VAR = "EMBER_BENCH_FEED_SIDE"


def _own_workers(name: str, run: Run) -> Run:
    """``run`` with its tasks in PySpark workers no other side's task ran in.

    PySpark reuses its Python workers from task to task, one pool per set of
    environment variables of the task's function (the SparkContext's
    ``environment`` when the function is wrapped).  TensorFlowOnSpark's
    feeding task imports TensorFlow into the worker it runs in (321,869
    objects), and every task of another side that ran in that worker after it
    carried those objects, its cyclic collections included.  A variable
    naming the side gives each side its own pool, so that none is measured
    in the state another left."""
    def in_own_workers() -> Dict[str, float]:
        from pyspark import SparkContext

        sc = SparkContext._active_spark_context
        assert sc is not None, "bench-feed: no SparkContext"
        env = sc.environment
        env[WORKER_POOL_VAR] = name
        try:
            return run()
        finally:
            env.pop(WORKER_POOL_VAR, None)
    return in_own_workers


#: Uncounted runs of each side before the rounds (see _warm_up).
WARM_UP_RUNS = 3


def _warm_up(sides: Dict[str, Run]) -> None:
    """WARM_UP_RUNS runs of each side before the rounds, interleaved, not
    counted: each side's path through the JVM is compiled by its JIT over
    the first runs, and without them whichever side another comparison's
    runs had already warmed would be measured warm and the other cold.
    Ember's RDD feed ran 155,000-186,000 records/s in its first three runs
    on a fresh session, 199,000-217,000 after; on 2026-11-28 the driver
    JVM's CPU per run fell over three runs from 3.15 to 1.52 s (Ember's RDD
    feed) and from 1.97 to 1.34 s (Spark's RDD ceiling), and with one
    warm-up the ceiling's rounds spread over 113,187-170,502 records/s."""
    if QUICK:
        return  # the smoke run only checks that every side runs
    for i in range(WARM_UP_RUNS):
        for name, run in sides.items():
            r = run()
            print(f"  warm-up {i + 1}: {name}: {r['rows'] / r['secs']:,.0f} records/s "
                  "(not counted)", flush=True)


def _report(i: int, name: str, r: Dict[str, float], _secs: float) -> None:
    """rnd.interleaved's report: each run's records/s as it comes."""
    print(f"  round {i + 1}: {name}: {r['rows'] / r['secs']:,.0f} records/s", flush=True)


def _checked(name: str, r: Dict[str, float], n: int, want: float) -> Dict[str, float]:
    _check(name, r, n, want)
    return r


def _check(name: str, r: Dict[str, float], n: int, want: float) -> None:
    if r["rows"] != n or abs(r["sum"] - want) > 1e-6 * max(1.0, abs(want)):
        raise SystemExit(f"{name}: consumer got {r['rows']} records summing to {r['sum']}, "
                         f"expected {n} summing to {want}")


if __name__ == "__main__":
    sys.exit(main())
