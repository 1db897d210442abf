"""make bench-train: what a user waits for, a training job end to end, Ember
against the peers and against the limit of the cores.

The job is the main job's (examples/fashion_mnist): the 784-256-128-10 MLP,
Adam 1e-3, 2 trainer nodes with a batch of 64 each (a global batch of 128),
3 epochs of Fashion-MNIST's 60,000 training images (the main job's accuracy
bar of 0.85 needs 3), then the test accuracy of what was saved, on the
10,000 test images, measured outside every clock.  The sides:

* ``ember_spark``: the main job's InputMode.SPARK (``model.train_spark``:
  its custom loop on Ember's collective) fed from a cached DataFrame whose
  image is a tensor column (ember.tensors.pack: the feed's fastest layout);
* ``ember_tf``: its InputMode.TENSORFLOW (``model.train_tf``), each node
  reading its share of the TFRecords with Ember's C reader;
* ``limit``: the same model in one process with as many threads as the
  cluster has cores, ``fit`` from in-memory arrays at the global batch: what
  the cores compute with no feed and no collective;
* ``tfos``: TensorFlowOnSpark 2.2.5's own ``TFCluster.run``/``train`` with its
  Keras program (bench/train_nodes.py ``tfos_main``: MultiWorkerMirroredStrategy,
  its feed read a batch at a time) from a cached RDD of (image, label);
* ``ember_torch``: the same layers in PyTorch, DDP on Ember's collective,
  fed through ``ember.torch.FeedDataset`` from the same DataFrame;
* ``torchdistributor``: ``pyspark.ml.torch.distributor.TorchDistributor``
  (2 processes, DDP over gloo) with the fastest data path its users have: the
  DataFrame (image an array<float>) written to Parquet (timed: it is part of
  that job), each process reading its share of the files with pyarrow, the
  list column flattened into one float32 array without a Python object per
  value, into tensors and a DataLoader.  (Its
  documented alternative, a Petastorm converter, is not maintained for
  Spark 4.)

Where: a Spark standalone cluster on this host with two 1-core Workers
(``--placement loopback``), the like of ``local[2]`` that every side can use
(TensorFlowOnSpark needs an executor per node, which local mode's single
executor is not), or the simulated hosts (``--placement hosts``: the driver
and two 1-core Workers on hosts of their own, tests/python/simcluster.py,
root).  Every side gets the same 2 cores.

Each side is timed end to end: from the call that starts its cluster to the
return of the call that ends it (its model saved).  And in steady state:
the records of the steps after the first epoch's, over the time from the end
of the first epoch's steps to the last step (its rank 0's clock), so that
start-up and tracing are out.  Rounds are interleaved (bench/rounds.py),
median [min-max].

    make bench-train                          # loopback, 3 rounds
    BENCH_TRAIN_ARGS="--placement hosts" make bench-train

EMBER_BENCH_QUICK=1: 4,096 records, 2 epochs (the steady state is the
second), one round; the accuracy is then not the bar's.  Ends with ``RESULT train vs_limit=<x> vs_tfos=<x>
vs_torchdistributor=<x> ...``: vs_limit is Ember's steady-state rate
(InputMode.SPARK) over the limit's; vs_tfos and vs_torchdistributor are the
peers' end-to-end seconds over Ember's.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional

import numpy as np

import rounds

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [REPO, os.path.join(REPO, "tests", "python")]
QUICK = os.environ.get("EMBER_BENCH_QUICK", "") not in ("", "0")
SIDES = ("ember_spark", "ember_tf", "limit", "tfos", "ember_torch", "torchdistributor")
NODES = 2
BATCH = 64
PARTITIONS = 4

logger = logging.getLogger("ember.bench.train")


class Job:
    """One placement's Spark session and the data every side starts from."""

    def __init__(self, spark: Any, work: str, records: int, epochs: int) -> None:
        from examples.fashion_mnist import data
        from ember.tensors import pack

        self.spark, self.sc, self.work = spark, spark.sparkContext, work
        self.records, self.epochs = records, epochs
        images, labels = data.load_split("train")
        images, labels = images[:records], labels[:records]
        # image array<float>: the DataFrame a user has; packed as a tensor
        # column (one binary value per row) for Ember's feed, its fastest layout
        self.arrays = data.to_dataframe(spark, images, labels, PARTITIONS).select("image", "label")
        self.df = pack(self.arrays, {"image": (784,)}).cache()
        self.df.count()
        x = images.reshape(records, 784).astype(np.float32) / 255.0
        self.rdd = self.sc.parallelize([(x[i], int(labels[i])) for i in range(records)],
                                       PARTITIONS).cache()
        self.rdd.count()
        self.data_dir = work  # the main job's layout: <data_dir>/tfrecords/train
        data.to_tfrecords(spark, images, labels, os.path.join(work, "tfrecords", "train"),
                          PARTITIONS)
        test_x, test_y = data.load_split("test")
        self.test_x = test_x.reshape(len(test_x), 784).astype(np.float32) / 255.0
        self.test_y = test_y.astype(np.int64)
        self.reports: List[str] = []  # the nodes' progress lines (the driver's log)

    def fresh(self, side: str) -> str:
        out = os.path.join(self.work, side)
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        return out


# --------------------------------------------------------------------------- evaluation

def _tf_accuracy(job: Job, export: str) -> float:
    import tensorflow as tf

    serve = tf.saved_model.load(export).signatures["serving_default"]
    classes = serve(image=tf.constant(job.test_x))["classes"].numpy()
    return float(np.mean(classes == job.test_y))


def _torch_accuracy(job: Job, path: str) -> float:
    import torch

    from train_nodes import _torch_model

    model = _torch_model()
    model.load_state_dict(torch.load(path))
    model.eval()
    with torch.no_grad():
        classes = model(torch.from_numpy(job.test_x)).argmax(1).numpy()
    return float(np.mean(classes == job.test_y))


def _clocked(out: str, side: str, global_batch: int) -> Dict[str, float]:
    """A side's steady state from its rank 0's step clock (train_nodes.py)."""
    with open(os.path.join(out, f"{side}.json")) as f:
        c = json.load(f)
    steps = c["steps"] - c["first"]
    seconds = (c["t_last"] - c["t_first"]) if steps > 0 else float("nan")
    return dict(steady_rps=steps * global_batch / seconds if steps > 0 else float("nan"),
                steps=c["steps"])


# --------------------------------------------------------------------------- the sides

def _ember_args(job: Job, out: str, threads: int) -> Any:
    return argparse.Namespace(
        epochs=job.epochs, batch_size=BATCH, learning_rate=1e-3, collective="ember",
        intra_op_threads=threads, inter_op_threads=threads, train_records=job.records,
        model_dir=os.path.join(out, "model"), export_dir=os.path.join(out, "export"),
        out_dir=out, data_dir=job.data_dir, train_limit=job.records,
        test_limit=0, partitions=PARTITIONS)


# the chief's line only: every node reports each epoch, and counting the
# worker's too would add each epoch's seconds twice
_EPOCH_DONE = re.compile(r"chief:0 epoch (\d+) done: step (\d+) ([\d.]+)s")


def _ember_steady(job: Job, since: int) -> Dict[str, float]:
    """InputMode.SPARK/TENSORFLOW of the main job: its chief reports each
    epoch's steps and seconds; the steady state is the epochs after the
    first."""
    epochs = [(int(m.group(1)), int(m.group(2)), float(m.group(3)))
              for line in job.reports[since:] for m in [_EPOCH_DONE.search(line)] if m]
    later = [e for e in epochs if e[0] > 1]
    first_steps = next((s for e, s, _ in epochs if e == 1), 0)
    if not later:
        return dict(steady_rps=float("nan"), steps=first_steps)
    steps = later[-1][1] - first_steps
    return dict(steady_rps=steps * BATCH * NODES / sum(t for _, _, t in later),
                steps=later[-1][1])


def _main_job(job: Job, side: str) -> Dict[str, float]:
    """The main job in InputMode.SPARK (``ember_spark``: fed the cached
    DataFrame) or InputMode.TENSORFLOW (``ember_tf``: its nodes read the
    TFRecords)."""
    from ember.spark import InputMode, run
    from examples.fashion_mnist import model

    fed = side == "ember_spark"
    out = job.fresh(side)
    since = len(job.reports)
    t0 = time.perf_counter()
    cluster = run(job.sc, model.train_spark if fed else model.train_tf,
                  _ember_args(job, out, 1), num_executors=NODES,
                  input_mode=InputMode.SPARK if fed else InputMode.TENSORFLOW)
    try:
        if fed:
            cluster.train(job.df, job.epochs)
    finally:
        cluster.shutdown()
    e2e = time.perf_counter() - t0
    return dict(_ember_steady(job, since), e2e_s=e2e,
                accuracy=_tf_accuracy(job, os.path.join(out, "export")))


def ember_spark(job: Job) -> Dict[str, float]:
    return _main_job(job, "ember_spark")


def ember_tf(job: Job) -> Dict[str, float]:
    return _main_job(job, "ember_tf")


def limit(job: Job) -> Dict[str, float]:
    out = job.fresh("limit")
    t0 = time.perf_counter()
    subprocess.run([sys.executable, os.path.join(HERE, "train_nodes.py"), "limit",
                    str(job.epochs), str(BATCH * NODES), str(NODES), out, str(job.records)],
                   check=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    e2e = time.perf_counter() - t0
    return dict(_clocked(out, "limit", BATCH * NODES), e2e_s=e2e,
                accuracy=_tf_accuracy(job, os.path.join(out, "limit-export")))


def tfos(job: Job) -> Dict[str, float]:
    from tensorflowonspark import TFCluster

    import train_nodes

    out = job.fresh("tfos")
    args = dict(out=out, epochs=job.epochs, batch=BATCH, threads=1, records=job.records)
    t0 = time.perf_counter()
    cluster = TFCluster.run(job.sc, train_nodes.tfos_main, args, NODES, num_ps=0,
                            input_mode=TFCluster.InputMode.SPARK, master_node="chief",
                            reservation_timeout=300)
    cluster.train(job.rdd, job.epochs)
    cluster.shutdown(timeout=600)
    e2e = time.perf_counter() - t0
    return dict(_clocked(out, "tfos", BATCH * NODES), e2e_s=e2e,
                accuracy=_tf_accuracy(job, os.path.join(out, "tfos-export")))


def ember_torch(job: Job) -> Dict[str, float]:
    from ember.spark import InputMode, run

    import train_nodes

    out = job.fresh("ember_torch")
    args = dict(out=out, batch=BATCH, threads=1, records=job.records)
    t0 = time.perf_counter()
    cluster = run(job.sc, train_nodes.ember_torch_main, args, num_executors=NODES,
                  input_mode=InputMode.SPARK)
    try:
        cluster.train(job.df, job.epochs)
    finally:
        cluster.shutdown()
    e2e = time.perf_counter() - t0
    return dict(_clocked(out, "ember_torch", BATCH * NODES), e2e_s=e2e,
                accuracy=_torch_accuracy(job, os.path.join(out, "ember_torch.pt")))


def torchdistributor(job: Job) -> Dict[str, float]:
    from pyspark.ml.torch.distributor import TorchDistributor

    import train_nodes

    out = job.fresh("torchdistributor")
    parquet = os.path.join(out, "data.parquet")
    args = dict(out=out, batch=BATCH, threads=1, records=job.records, epochs=job.epochs)
    t0 = time.perf_counter()
    job.arrays.write.parquet(parquet)
    TorchDistributor(num_processes=NODES, local_mode=False, use_gpu=False).run(
        train_nodes.torchdistributor_main, parquet, args)
    e2e = time.perf_counter() - t0
    return dict(_clocked(out, "torchdistributor", BATCH * NODES), e2e_s=e2e,
                accuracy=_torch_accuracy(job, os.path.join(out, "torchdistributor.pt")))


RUNNERS: Dict[str, Callable[[Job], Dict[str, float]]] = {
    "ember_spark": ember_spark, "ember_tf": ember_tf, "limit": limit, "tfos": tfos,
    "ember_torch": ember_torch, "torchdistributor": torchdistributor}


# --------------------------------------------------------------------------- placements

class _Reports(logging.Handler):
    """Keeps the nodes' progress lines, which the driver logs."""

    def __init__(self, job_reports: List[str]) -> None:
        super().__init__(logging.INFO)
        self.lines = job_reports

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _session(master: str, extra: Dict[str, str]) -> Any:
    from pyspark.sql import SparkSession

    os.environ["PYSPARK_PYTHON"] = sys.executable
    builder = (SparkSession.builder.master(master).appName("ember-bench-train")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.executor.cores", "1").config("spark.cores.max", str(NODES))
               .config("spark.executor.memory", "2g")
               .config("spark.driver.memory", "2g")  # TensorFlowOnSpark's RDD lives here
               .config("spark.pyspark.python", sys.executable)
               .config("spark.executorEnv.PYTHONPATH",
                       os.pathsep.join([REPO, HERE, os.path.join(REPO, "python")]))
               .config("spark.scheduler.minRegisteredResourcesRatio", "1.0")
               .config("spark.scheduler.maxRegisteredResourcesWaitingTime", "120s"))
    for k, v in extra.items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    return spark


def loopback(work: str) -> Any:
    """A standalone Master and two 1-core Workers on 127.0.0.1 (tests' Standalone)."""
    from conftest import Standalone

    cluster = Standalone(os.path.join(work, "standalone"), workers=NODES, cores=1,
                         memory="3g")
    os.makedirs(cluster.root, exist_ok=True)
    cluster.start()
    spark = _session(cluster.url, {"spark.driver.host": "127.0.0.1",
                                   "spark.driver.bindAddress": "127.0.0.1"})
    return spark, cluster.stop


HOSTS = ["driver", "master", "w1", "w2"]


def on_hosts(argv: List[str], work: str) -> int:
    """--placement hosts: the simulated hosts and their Spark cluster, then
    this program again as the driver on host ``driver`` (--placement
    hosts-driver), whose output is printed as it comes."""
    import simcluster
    from spark_hosts import SparkOnHosts

    why = simcluster.available()
    if why is not None:
        print(f"RESULT train skipped=no_simulated_hosts ({why})")
        return 0
    with simcluster.SimCluster(HOSTS, prefix="embtr") as sim:
        cluster = SparkOnHosts(sim, work, HOSTS[2:])
        cluster.start()
        driver = cluster.driver([sys.executable, os.path.abspath(__file__), *argv,
                                 "--placement", "hosts-driver"], "driver.log")
        log_path = os.path.join(work, "driver.log")
        with open(log_path) as log:
            while True:
                line = log.readline()
                if line:
                    sys.stdout.write(line)
                    sys.stdout.flush()
                elif driver.poll() is not None:
                    sys.stdout.write(log.read())
                    break
                else:
                    time.sleep(0.5)
    return int(driver.returncode)


def hosts_driver() -> Any:
    """The session of the driver on host ``driver`` (spark_hosts.SparkOnHosts)."""
    import socket

    me = socket.gethostname()
    return _session("spark://master:7077", {"spark.driver.host": me,
                                            "spark.driver.bindAddress":
                                                socket.gethostbyname(me)}), (lambda: None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1 if QUICK else 3)
    ap.add_argument("--epochs", type=int, default=2 if QUICK else 3)
    ap.add_argument("--records", type=int, default=4096 if QUICK else 60000)
    ap.add_argument("--sides", default=",".join(SIDES))
    ap.add_argument("--placement", choices=("loopback", "hosts", "hosts-driver"),
                    default="loopback")
    a = ap.parse_args()
    sides = [s for s in a.sides.split(",") if s]
    unknown = set(sides) - set(SIDES)
    if unknown:
        ap.error(f"unknown side(s) {', '.join(sorted(unknown))}; sides: {', '.join(SIDES)}")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("ember").setLevel(logging.INFO)
    work = tempfile.mkdtemp(prefix="ember-bench-train-")
    try:
        return _run(a, sides, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(a: Any, sides: List[str], work: str) -> int:
    if a.placement == "hosts":
        argv = list(sys.argv[1:])
        if "--placement" in argv:
            i = argv.index("--placement")
            del argv[i:i + 2]
        return on_hosts(argv, work)
    spark, stop = loopback(work) if a.placement == "loopback" else hosts_driver()
    try:
        t0 = time.perf_counter()
        job = Job(spark, work, a.records, a.epochs)
        print(f"bench-train: {a.records} records x {a.epochs} epoch(s), {NODES} nodes x "
              f"batch {BATCH}, {a.placement}; data ready in {time.perf_counter() - t0:.0f} s",
              flush=True)
        handler = _Reports(job.reports)
        logging.getLogger("ember").addHandler(handler)

        def report(r: int, side: str, got: Dict[str, float], seconds: float) -> None:
            print(f"round {r}: {side:17s} end to end {got['e2e_s']:7.1f} s   steady "
                  f"{got['steady_rps']:9,.0f} records/s   accuracy {got['accuracy']:.4f}",
                  flush=True)

        def failed(r: int, side: str, exc: Exception, seconds: float) -> None:
            print(f"round {r}: {side}: FAILED after {seconds:.0f} s: "
                  f"{type(exc).__name__}: {str(exc)[:1500]}", flush=True)

        got = rounds.interleaved(a.rounds, {s: (lambda s=s: RUNNERS[s](job)) for s in sides},
                                 report=report, failed=failed)
    finally:
        spark.stop()
        stop()
    return _summary(got, a)


def _summary(got: Dict[str, List[Dict[str, float]]], a: Any) -> int:
    med: Dict[str, Dict[str, float]] = {}
    print(f"\n{'side':17s} {'end to end (s)':>24s} {'steady (records/s)':>30s} "
          f"{'accuracy':>18s}")
    for side, results in got.items():
        if not results:
            print(f"{side:17s} no result")
            continue
        cols = {k: [r[k] for r in results] for k in ("e2e_s", "steady_rps", "accuracy")}
        med[side] = {k: rounds.spread(v).median for k, v in cols.items()}
        print(f"{side:17s} {rounds.fmt_spread(cols['e2e_s'], '.1f'):>24s} "
              f"{rounds.fmt_spread(cols['steady_rps'], ',.0f'):>30s} "
              f"{rounds.fmt_spread(cols['accuracy'], '.4f'):>18s}")

    def ratio(num: Optional[float], den: Optional[float]) -> float:
        return num / den if num and den else float("nan")

    def m(side: str, key: str) -> Optional[float]:
        return med.get(side, {}).get(key)

    missing = [s for s in SIDES if s not in med]
    fields = dict(
        vs_limit=ratio(m("ember_spark", "steady_rps"), m("limit", "steady_rps")),
        vs_tfos=ratio(m("tfos", "e2e_s"), m("ember_spark", "e2e_s")),
        vs_torchdistributor=ratio(m("torchdistributor", "e2e_s"), m("ember_torch", "e2e_s")),
        vs_limit_tf=ratio(m("ember_tf", "steady_rps"), m("limit", "steady_rps")),
        steady_vs_tfos=ratio(m("ember_spark", "steady_rps"), m("tfos", "steady_rps")),
        steady_vs_torchdistributor=ratio(m("ember_torch", "steady_rps"),
                                         m("torchdistributor", "steady_rps")))
    for side in SIDES:
        for key, name in (("e2e_s", "e2e_s"), ("steady_rps", "rps"), ("accuracy", "acc")):
            fields[f"{side}_{name}"] = m(side, key) if m(side, key) is not None \
                else float("nan")
    line = " ".join(f"{k}={v:.4g}" for k, v in fields.items())
    extra = f" not_measured={','.join(missing)}" if missing else ""
    print(f"\nRESULT train {line} records={a.records} epochs={a.epochs} rounds={a.rounds} "
          f"nodes={NODES} batch={BATCH} placement={a.placement}{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
