"""A Spark Connect client of Ember, run by the tests in a process of its own
(``connect_fixture.run_client``): ``python connect_client.py <scenario>
<sc://url> <out dir>``.  It uses ``SparkSession.builder.remote`` and never
starts a JVM (checked at the end);
it writes what it saw to ``<out dir>/<scenario>.json``.  The executors of the
Connect server import this module for the node functions below."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


# --------------------------------------------------------------------------- node functions

def slow_reader(args: Any, ctx: Any) -> None:
    """Reads the feed slowly, after writing its pid where the client finds it."""
    with open(os.path.join(args["out"], f"pid-{ctx.worker_num}"), "w") as f:
        f.write(str(os.getpid()))
    feed = ctx.get_data_feed(train_mode=True)
    while not feed.should_stop():
        feed.next_batch(50)
        time.sleep(0.05)


# --------------------------------------------------------------------------- checks

def _java_children() -> List[int]:
    """Pids of java processes this process started (none for a Connect client)."""
    me, found = os.getpid(), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        if int(fields[1]) == me and comm == "java":
            found.append(int(pid))
    return found


def _no_jvm() -> Dict[str, Any]:
    from pyspark import SparkContext

    return dict(gateway=SparkContext._gateway is not None, java_children=_java_children())


# --------------------------------------------------------------------------- scenarios

def _strangers(address: Any) -> List[str]:
    """What the coordinator's control channel answers a peer with a wrong
    secret and one that sends garbage (the cluster must go on serving)."""
    import socket

    from ember import _ember

    host, port = address
    seen = []
    try:
        _ember.FeedClient(host, port, b"not the job secret", 0, timeout_s=5.0).close()
        seen.append("accepted")
    except _ember.EmberError as exc:
        seen.append(type(exc).__name__)
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"\xff" * 4096)
        s.settimeout(5)
        try:
            seen.append("closed" if s.recv(4096) is not None else "open")
        except OSError as exc:
            seen.append(type(exc).__name__)
    return seen


def killed_node(url: str, out: str) -> Dict[str, Any]:
    """SIGKILLs node 1 while train(df) feeds it: the error names the node."""
    import signal

    from pyspark.sql import SparkSession

    import ember.spark as es

    spark = SparkSession.builder.remote(url).getOrCreate()
    cluster = es.run(spark, slow_reader, {"out": out}, num_executors=2,
                     input_mode=es.InputMode.SPARK, reservation_timeout=120)
    result: Dict[str, Any] = dict(strangers=_strangers(cluster._coordinator))
    killed: Dict[str, float] = {}

    def kill() -> None:
        pid_file = os.path.join(out, "pid-1")
        deadline = time.monotonic() + 120
        while not os.path.exists(pid_file) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(3)  # feeding by now: 2 x 100,000 rows take minutes at this pace
        os.kill(int(open(pid_file).read()), signal.SIGKILL)
        killed["at"] = time.monotonic()

    threading.Thread(target=kill, daemon=True).start()
    try:
        cluster.train(spark.range(200000).selectExpr("id", "id % 10 AS label"), 1)
        result["raised"] = None
    except Exception as exc:  # noqa: BLE001 - what was raised is the result
        result.update(raised=type(exc).__name__, message=str(exc)[:3000],
                      node=getattr(exc, "node", None),
                      after_kill=time.monotonic() - killed.get("at", time.monotonic()))
    try:
        cluster.shutdown(timeout=60)
        result["shutdown"] = None
    except Exception as exc:  # noqa: BLE001
        result["shutdown"] = type(exc).__name__
    spark.stop()
    return result


def _kill_after_first_checkpoint(out: str, holder: Dict[str, Any]) -> None:
    """SIGKILLs node 1 once both nodes checkpointed a whole epoch and node 1
    trained 200 records past it.  (Over Connect a node may get batches of the
    next epoch before the last ones of its own: the epochs' partitions are
    fed by tasks that run side by side, and the labels tell them apart.)"""
    import signal

    import nodefuns

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        run0 = nodefuns.epoch_counts(out).get((1, 0))
        try:
            ckpts = [int(open(os.path.join(out, f"ckpt-{i}")).read()) for i in (0, 1)]
        except (OSError, ValueError):
            ckpts = []
        if run0 and ckpts and min(ckpts) >= 1 and \
                sum(run0["counts"].values()) >= 1000 * ckpts[1] + 200:
            holder.update(counts=run0["counts"], ckpts=ckpts)
            os.kill(run0["pid"], signal.SIGKILL)
            return
        time.sleep(0.02)


def restart(url: str, out: str) -> Dict[str, Any]:
    """max_restarts=1: node 1 SIGKILLed after its first checkpoint; the
    restarted nodes resume from their checkpoints and train() feeds the
    epochs from the smallest on (test_recovery's classic test, over Connect)."""
    from pyspark.sql import SparkSession

    import ember.spark as es
    import nodefuns

    spark = SparkSession.builder.remote(url).getOrCreate()
    n, epochs = 2000, 3
    cluster = es.run(spark, nodefuns.epoch_checkpoints, {"out": out, "step": 0.1},
                     num_executors=2, input_mode=es.InputMode.SPARK, reservation_timeout=60,
                     heartbeat_timeout=4, max_restarts=1)
    holder: Dict[str, Any] = {}
    killer = threading.Thread(target=_kill_after_first_checkpoint, args=(out, holder))
    killer.start()
    try:
        fed = cluster.train(spark.range(n).selectExpr("id", "CAST(id AS FLOAT) AS x"),
                            num_epochs=epochs, feed_timeout=120)
    finally:
        killer.join()
        cluster.shutdown(timeout=60)
    runs = nodefuns.epoch_counts(out)
    spark.stop()

    def per_epoch(attempt: int) -> Dict[int, int]:
        return {e: sum(runs[i, attempt]["counts"].get(e, 0) for i in (0, 1) if (i, attempt) in runs)
                for e in range(epochs)}

    return dict(killed="counts" in holder, ckpts=holder.get("ckpts"), restarts=cluster.restarts,
                cause_node=cluster.restart_causes[0].node if cluster.restart_causes else None,
                runs=sorted([list(k) for k in runs]), fed=fed, n=n, epochs=epochs,
                starts=[runs[i, 1]["start"] for i in (0, 1) if (i, 1) in runs],
                before=per_epoch(0), after=per_epoch(1))


def pipeline(url: str, out: str) -> Dict[str, Any]:
    """EmberEstimator fit -> EmberModel transform in a Pipeline, save and load."""
    import argparse

    from pyspark.ml import PipelineModel
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator
    from pyspark.sql import SparkSession

    from examples.fashion_mnist import model as fm
    from ember.ml import TFEstimator
    from ml_fashion import fashion_frame, fashion_pipeline

    spark = SparkSession.builder.remote(url).getOrCreate()
    # a quarter of the training set: what is tested is the Pipeline's way
    # through Connect; test_ml.py trains the full set to the 0.85 bar
    train = fashion_frame(spark, "train", limit=15000, parts=4)
    test = fashion_frame(spark, "test", parts=2)
    args = argparse.Namespace(learning_rate=1e-3, intra_op_threads=1, inter_op_threads=1,
                              train_records=15000)
    est = TFEstimator(fm.train_spark, args)
    fitted = fashion_pipeline(est, 2, out).fit(train)
    scored = fitted.transform(test).cache()  # scored once, for the evaluator and the ids
    accuracy = MulticlassClassificationEvaluator(
        labelCol="label", predictionCol="prediction", metricName="accuracy").evaluate(scored)
    first = {r["id"]: r["prediction"] for r in scored.select("id", "prediction").collect()}
    fitted.write().overwrite().save(os.path.join(out, "pipeline_model"))
    again = PipelineModel.load(os.path.join(out, "pipeline_model"))
    second = {r["id"]: r["prediction"]
              for r in again.transform(test).select("id", "prediction").collect()}
    spark.stop()
    return dict(accuracy=accuracy, rows=len(first), same=first == second,
                model=type(fitted.stages[1]).__name__)


SCENARIOS = {"kill": killed_node, "restart": restart, "pipeline": pipeline}

if __name__ == "__main__":
    scenario, url, out = sys.argv[1:4]
    sys.path[:0] = [REPO, HERE]
    os.makedirs(out, exist_ok=True)
    record = SCENARIOS[scenario](url, out)
    record.update(_no_jvm())
    with open(os.path.join(out, f"{scenario}.json"), "w") as f:
        json.dump(record, f)
