"""An Ember job on Spark on YARN (client mode), run as its own process by
tests/python/test_spark_yarn.py (one JVM per process: a YARN driver cannot
share the test session's local Spark).

    HADOOP_CONF_DIR=<mini cluster conf> python tests/python/yarn_job.py \\
        --mode venv|archive --work DIR --out result.json

It starts a SparkSession on ``--master yarn`` with 2 executors (1 core,
512 MiB heap + 1.5 GiB overhead each: the Python worker and the Ember node
with TensorFlow live in the overhead), trains the Fashion-MNIST model with
``ember.spark.run`` (InputMode.SPARK, 2 nodes, a few thousand records), runs
inference with the exported SavedModel on 2 nodes, and writes what happened
(accuracy, where the executors ran, which Ember they imported) as JSON.

Shipping the Python environment:
  venv     the interpreter and packages are the ones on this host
           (``PYSPARK_PYTHON`` = this venv's python, which is what a session
           created from Python uses; ``spark.pyspark.python`` is the
           spark-submit equivalent; the NodeManager
           runs on the same host, as on a grid whose nodes share a software
           image or an NFS-mounted environment).
  archive  the Ember package (with its compiled extension) and the example
           code travel as a zip in ``spark.archives`` (``#deps``), unpacked
           by YARN into each container's working directory, and
           ``spark.executorEnv.PYTHONPATH={{PWD}}/deps`` puts it first; the
           interpreter is still this host's.  A whole packed environment
           (venv-pack / conda-pack ``env.tar.gz#environment`` with
           ``spark.pyspark.python=./environment/bin/python``) goes the same
           way; it is not packed here because this venv (TensorFlow) is
           GBs.
Spark's own jars are not uploaded: ``spark.yarn.jars=local:<pyspark>/jars/*``
(present on the NodeManager's host); pyspark.zip and py4j come from
pyspark's ``python/lib`` (pip's pyspark 4.3.0 ships them, and
spark-yarn_2.13-4.3.0.jar).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import zipfile

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build_archive(path: str) -> str:
    """ember/ (with _ember*.so) and examples/ as a zip for spark.archives."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for top, root in (("ember", os.path.join(REPO, "python", "ember")),
                          ("examples", os.path.join(REPO, "examples"))):
            for d, dirs, files in os.walk(root):
                dirs[:] = [x for x in dirs if x != "__pycache__"]
                for f in files:
                    if f.endswith((".py", ".so")):
                        full = os.path.join(d, f)
                        z.write(full, os.path.join(top, os.path.relpath(full, root)))
    return path


def session(mode: str, work: str):
    import pyspark
    from pyspark.sql import SparkSession

    home = os.path.dirname(pyspark.__file__)
    java = shutil.which("java")
    if java is None:
        raise SystemExit("java not found")
    java_home = os.environ.get("JAVA_HOME") or os.path.dirname(
        os.path.dirname(os.path.realpath(java)))
    b = (SparkSession.builder.master("yarn").appName(f"ember-yarn-{mode}")
         .config("spark.submit.deployMode", "client")
         .config("spark.driver.host", "127.0.0.1")
         .config("spark.driver.bindAddress", "127.0.0.1")
         .config("spark.ui.enabled", "false")
         .config("spark.executor.instances", "2")
         .config("spark.executor.cores", "1")
         .config("spark.executor.memory", "512m")
         .config("spark.executor.memoryOverhead", "1536m")
         .config("spark.yarn.am.memory", "512m")
         .config("spark.yarn.maxAppAttempts", "1")
         .config("spark.yarn.jars", f"local:{home}/jars/*")
         .config("spark.yarn.appMasterEnv.JAVA_HOME", java_home)
         .config("spark.executorEnv.JAVA_HOME", java_home)
         .config("spark.pyspark.python", sys.executable)
         # the barrier stage needs both executors: wait for them up front
         .config("spark.scheduler.minRegisteredResourcesRatio", "1.0")
         .config("spark.scheduler.maxRegisteredResourcesWaitingTime", "300s")
         .config("spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures", "3")
         .config("spark.executorEnv.HADOOP_CONF_DIR", os.environ["HADOOP_CONF_DIR"]))
    if mode == "archive":
        zip_path = build_archive(os.path.join(work, "ember-deps.zip"))
        b = (b.config("spark.archives", f"{zip_path}#deps")
             .config("spark.executorEnv.PYTHONPATH", "{{PWD}}/deps"))
    else:
        b = b.config("spark.executorEnv.PYTHONPATH",
                     os.pathsep.join([REPO, os.path.join(REPO, "python")]))
    return b.getOrCreate()


def where(_):
    import ember
    import examples.fashion_mnist.model as m

    yield (os.environ.get("CONTAINER_ID", ""), os.path.realpath(ember.__file__),
           os.path.realpath(m.__file__), sys.executable, os.getcwd())


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["venv", "archive"], required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--train", type=int, default=4000)
    p.add_argument("--test", type=int, default=1000)
    p.add_argument("--epochs", type=int, default=2)
    a = p.parse_args()
    os.makedirs(a.work, exist_ok=True)
    t0 = time.monotonic()
    spark = session(a.mode, a.work)
    sc = spark.sparkContext
    sc.setLogLevel("WARN")
    result = {"mode": a.mode, "app_id": sc.applicationId, "master": sc.master,
              "startup_s": round(time.monotonic() - t0, 1)}
    try:
        from examples.fashion_mnist import data, model

        from ember.spark import InputMode, run

        result["executors"] = sc.parallelize(range(2), 2).mapPartitions(where).collect()
        images, labels = data.load_split("train")
        train = sc.parallelize(data.to_records(images[:a.train], labels[:a.train]), 4)
        timages, tlabels = data.load_split("test")
        test = sc.parallelize(data.to_records(timages[:a.test], tlabels[:a.test]), 2)
        args = argparse.Namespace(batch_size=32, learning_rate=1e-3, epochs=a.epochs,
                                  train_records=a.train, infer_batch_size=256,
                                  model_dir=os.path.join(a.work, "model"),
                                  export_dir=os.path.join(a.work, "export"),
                                  intra_op_threads=1, inter_op_threads=1)
        t1 = time.monotonic()
        cluster = run(sc, model.train_spark, args, num_executors=2, num_ps=0,
                      input_mode=InputMode.SPARK, reservation_timeout=300)
        try:
            result["trained"] = cluster.train(train, a.epochs)
        finally:
            cluster.shutdown(timeout=300)
        result["train_s"] = round(time.monotonic() - t1, 1)
        cluster = run(sc, model.infer, args, num_executors=2, input_mode=InputMode.SPARK,
                      master_node=None, reservation_timeout=300)
        try:
            pairs = np.asarray(cluster.inference(test).collect(), dtype=np.int64).reshape(-1, 2)
        finally:
            cluster.shutdown(timeout=300)
        result["inferred"] = int(len(pairs))
        result["accuracy"] = float(np.mean(pairs[:, 0] == pairs[:, 1]))
        result["wall_s"] = round(time.monotonic() - t0, 1)
    finally:
        spark.stop()
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
