"""The driver of test_gpu.py's jobs on a standalone cluster whose Worker
advertises GPUs (fake addresses, or the machine's real ones), run as a
subprocess so that its SparkContext is its own: the test process keeps the
shared session of conftest.

    python gpu_job.py <work dir> <out.json> fake|real

``fake``: one Worker with 2 cores and GPUs "0" and "1", one executor holding
both; nodes of ``run(gpus_per_node=)``, requests the cluster cannot hold, and
EmberModel's direct and Arrow UDF paths with ``spark.task.resource.gpu.amount=1``.
``real``: the Worker discovers the machine's GPUs with nvidia-smi, and the
nodes report what TensorFlow sees; then the main job trains on the GPU.  What was observed goes to ``out.json``;
test_gpu.py asserts on it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(os.path.dirname(HERE)), "python")]


# --------------------------------------------------------------------------- node functions

def report_gpus(args: Dict[str, Any], ctx: Any) -> None:
    """Writes what this node was given: ctx.gpus and its CUDA environment (and,
    with args["tf"], the GPUs TensorFlow lists)."""
    info = dict(index=ctx.worker_num, gpus=ctx.gpus, pid=os.getpid(), host=ctx.host,
                cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
                cuda_device_order=os.environ.get("CUDA_DEVICE_ORDER"))
    if args.get("tf"):
        import tensorflow as tf

        info["tf_gpus"] = [d.name for d in tf.config.list_physical_devices("GPU")]
    path = os.path.join(args["out"], f"node-{ctx.worker_num}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(info, f)
    os.replace(path + ".tmp", path)


# --------------------------------------------------------------------------- driver

# Spark's getGpusResources.sh in short: the real GPUs' indexes as Spark's JSON
_NVIDIA_DISCOVERY = r"""#!/bin/sh
ADDRS=$(nvidia-smi --query-gpu=index --format=csv,noheader | paste -sd, - | sed 's/,/","/g')
echo "{\"name\": \"gpu\", \"addresses\": [\"$ADDRS\"]}"
"""

def _nodes(out: str) -> List[Dict[str, Any]]:
    found = []
    for name in sorted(os.listdir(out)):
        if name.startswith("node-") and name.endswith(".json"):
            with open(os.path.join(out, name)) as f:
                found.append(json.load(f))
    return found


def _launch(sc: Any, work: str, name: str, n: int, k: int, **extra: Any) -> Dict[str, Any]:
    from ember.spark import InputMode, run

    out = os.path.join(work, name)
    os.makedirs(out)
    cluster = run(sc, report_gpus, dict(out=out, **extra), num_executors=n,
                  input_mode=InputMode.TENSORFLOW, reservation_timeout=120, gpus_per_node=k)
    cluster.shutdown(timeout=120)
    return {"task_gpus": {str(i): g for i, g in cluster.gpus.items()}, "nodes": _nodes(out)}


def _refused(fn: Any) -> Dict[str, Any]:
    start = time.monotonic()
    try:
        fn()
    except ValueError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def _direct_worker_envs(work: str) -> Dict[int, Dict[str, str]]:
    """pid -> CUDA variables of each running direct-path inference worker of
    a model under ``work`` (another test's workers may run beside)."""
    found = {}
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            if b"ember._direct_launcher" not in argv or \
                    not any(a.startswith(work.encode()) for a in argv):
                continue
            with open(f"/proc/{d}/environ", "rb") as f:
                env = dict(v.decode().partition("=")[::2] for v in f.read().split(b"\0") if v)
        except OSError:
            continue
        found[int(d)] = {k: env.get(k) for k in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")}
    return found


def _inference(spark: Any, work: str, standalone: Any) -> Dict[str, Any]:
    """EmberModel on the direct path and on the Arrow UDF path, each task given one GPU."""
    import numpy as np
    import tensorflow as tf

    from ember.ml import EmberModel

    class Double(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32, name="x")])
        def serve(self, x):
            return {"y": x * 2.0}

    export = os.path.join(work, "double")
    m = Double()
    tf.saved_model.save(m, export, signatures={"serving_default": m.serve})
    rows = [(i, [float(i)] * 4) for i in range(400)]
    df = spark.createDataFrame(rows, "id long, x array<float>").repartition(4).cache()
    df.count()
    model = (EmberModel().setExportDir(export).setInputMapping({"x": "x"})
             .setOutputMapping({"y": "y"}).setBatchSize(50))
    result: Dict[str, Any] = {}
    for path, frame in (("direct", df), ("udf", df.coalesce(2))):
        got = model.setArrowPath(path).transform(frame).collect()
        result[f"{path}_ok"] = len(got) == 400 and all(
            np.allclose(r["y"], [2.0 * r["id"]] * 4) for r in got)
    result["direct_workers"] = _direct_worker_envs(work)
    # the Arrow UDF path's Python workers say which GPUs they took (executor stderr)
    lines = []
    for base, _dirs, files in os.walk(os.path.join(standalone.root, "work")):
        for f in files:
            if f == "stderr":
                with open(os.path.join(base, f), errors="replace") as fh:
                    lines += [ln.strip() for ln in fh if "inference worker pid" in ln]
    result["udf_log"] = lines
    df.unpersist()
    return result


def main(argv: List[str]) -> int:
    work, out_json, kind = argv[0], argv[1], argv[2]
    from conftest import Standalone, _base_builder

    result: Dict[str, Any] = {}
    root = os.path.join(work, "standalone")
    os.makedirs(root)
    if kind == "fake":
        standalone = Standalone(root, workers=1, cores=2, gpus=[["0", "1"]])
        discovery = standalone.discovery_script(["0", "1"])
        gpus_per_executor = 2
    else:
        standalone = Standalone(root, workers=1, cores=2)
        discovery = os.path.join(root, "nvidia-gpus.sh")
        with open(discovery, "w") as f:  # Spark's examples/.../getGpusResources.sh, in short
            f.write(_NVIDIA_DISCOVERY)
        os.chmod(discovery, 0o755)
        count = len(subprocess.check_output(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"]).split())
        # the Worker discovers the real GPUs (SPARK_WORKER_OPTS reaches its JVM)
        os.environ["SPARK_WORKER_OPTS"] = (
            f"-Dspark.worker.resource.gpu.amount={count} "
            f"-Dspark.worker.resource.gpu.discoveryScript={discovery}")
        gpus_per_executor = 1
    spark = None
    try:
        standalone.start()
        os.environ.pop("SPARK_WORKER_OPTS", None)
        builder = (_base_builder("ember-gpu-test").master(standalone.url)
                   .config("spark.executor.memory", "1g")
                   .config("spark.executor.cores", "2")
                   .config("spark.cores.max", "2")
                   .config("spark.executor.resource.gpu.amount", str(gpus_per_executor))
                   .config("spark.executor.resource.gpu.discoveryScript", discovery)
                   # the registration window: a request the cluster cannot hold fails after it
                   .config("spark.scheduler.maxRegisteredResourcesWaitingTime", "3s"))
        if kind == "fake":  # inference tasks: one GPU each; the Arrow UDF path's Python
            # workers serve one task each (a reused one would keep its first task's GPU)
            builder = (builder.config("spark.task.resource.gpu.amount", "1")
                       .config("spark.python.worker.reuse", "false"))
        spark = builder.getOrCreate()
        spark.sparkContext.setLogLevel("WARN")
        standalone.wait_executors(spark, 1)
        sc = spark.sparkContext
        if kind == "real":
            result["one"] = _launch(sc, work, "one", 1, 1, tf=True)
            spark.stop()
            spark = None
            # the main job on the real GPU: each node is given one by Spark
            repo = os.path.dirname(os.path.dirname(HERE))
            job = subprocess.run(
                [sys.executable, "-m", "examples.fashion_mnist.main", "--epochs", "3",
                 "--require-accuracy", "0.85", "--num-executors", "1", "--modes", "spark",
                 "--work-dir", os.path.join(work, "fmnist"), "--master", standalone.url,
                 "--gpus-per-node", "1",
                 "--conf", f"spark.executor.resource.gpu.amount={gpus_per_executor}",
                 "--conf", f"spark.executor.resource.gpu.discoveryScript={discovery}",
                 "--conf", "spark.executor.cores=2", "--conf", "spark.cores.max=2"],
                cwd=repo, capture_output=True, text=True, timeout=1200,
                env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                    [repo, os.path.join(repo, "python")]), PYTHONUNBUFFERED="1"))
            result["main_job"] = {"rc": job.returncode,
                                  "tail": (job.stdout + job.stderr)[-4000:]}
            return 0
        result["two"] = _launch(sc, work, "two", 2, 1)
        result["both"] = _launch(sc, work, "both", 1, 2)
        from ember.spark import run

        result["too_many_nodes"] = _refused(lambda: run(sc, report_gpus, {"out": work},
                                                        num_executors=3, gpus_per_node=1))
        result["too_many_gpus"] = _refused(lambda: run(sc, report_gpus, {"out": work},
                                                       num_executors=1, gpus_per_node=3))
        result["inference"] = _inference(spark, work, standalone)
    except BaseException:
        result["traceback"] = traceback.format_exc()
        raise
    finally:
        with open(out_json, "w") as f:
            json.dump(result, f, indent=1)
        if spark is not None:
            spark.stop()
        standalone.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
