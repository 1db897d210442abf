"""GPU placement by Spark's scheduler (``run(gpus_per_node=)``, EmberModel's tasks).

On a standalone cluster whose Worker advertises GPUs through a discovery
script (fake addresses "0" and "1": real Spark scheduling, no GPU needed),
driven by gpu_job.py in a subprocess: nodes get disjoint GPUs, exactly the
addresses of their barrier task's ``TaskContext.resources()``, as
``CUDA_VISIBLE_DEVICES``; a request larger than the cluster fails at once
naming what it has; EmberModel's direct-path workers and Arrow UDF workers
take their task's GPU.  Local mode refuses with what to configure.  With a
real GPU (nvidia-smi and a TensorFlow that sees it), the nodes' TensorFlow
sees exactly the assigned GPU and the main job trains on it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

import nodefuns
from ember.spark import InputMode, run

HERE = os.path.dirname(os.path.abspath(__file__))


def _gpu_job(tmp_path, kind: str, timeout: float) -> dict:
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, os.path.join(HERE, "gpu_job.py"), str(tmp_path),
                           str(out), kind], capture_output=True, text=True, timeout=timeout)
    result = json.loads(out.read_text()) if out.exists() else {}
    assert proc.returncode == 0 and "traceback" not in result, (
        result.get("traceback") or proc.stderr[-6000:])
    return result


def test_local_mode_cannot_schedule_gpus(local_spark, tmp_path):
    sc = local_spark.sparkContext
    with pytest.raises(ValueError, match=r"gpus_per_node=1: Spark's local mode \(local\[4\]\) "
                                         r"does not schedule GPUs.*spark\.executor\.resource\.gpu"
                                         r"\.amount.*discoveryScript"):
        run(sc, nodefuns.report_ctx, {"out": str(tmp_path)}, num_executors=2,
            input_mode=InputMode.TENSORFLOW, gpus_per_node=1)
    with pytest.raises(ValueError, match=r"gpus_per_node must be a whole number >= 1 \(nodes "
                                         r"never share a GPU\), got 0\.5"):
        run(sc, nodefuns.report_ctx, {"out": str(tmp_path)}, num_executors=2, gpus_per_node=0.5)
    assert not os.listdir(tmp_path)  # no node started


def test_arrow_paths_with_gpu_tasks_need_fresh_python_workers(local_spark):
    """EmberModel's Arrow UDF / mapInArrow paths with GPU tasks: a reused Python
    worker would keep its first task's GPU, so they need worker reuse off."""
    from pyspark import SparkConf

    from ember._gpu import check_python_worker_gpus

    conf = SparkConf(loadDefaults=False).set("spark.task.resource.gpu.amount", "1")
    with pytest.raises(ValueError, match=r"ArrowPath 'udf' with GPU tasks \(spark\.task\.resource"
                                         r"\.gpu\.amount=1\).*set spark\.python\.worker\.reuse="
                                         r"false, or use ArrowPath 'direct'"):
        check_python_worker_gpus(conf, "udf")
    check_python_worker_gpus(conf.set("spark.python.worker.reuse", "false"), "mapInArrow")
    check_python_worker_gpus(SparkConf(loadDefaults=False), "udf")  # no GPU tasks


def test_gpus_from_a_standalone_cluster_with_discovered_gpus(tmp_path):
    r = _gpu_job(tmp_path, "fake", timeout=420)

    # two nodes on one host (one executor holding GPUs 0 and 1), one GPU each
    two = r["two"]
    task = {int(i): g for i, g in two["task_gpus"].items()}  # TaskContext.resources()["gpu"]
    assert sorted(task) == [0, 1] and all(len(g) == 1 for g in task.values()), task
    assert sorted(task[0] + task[1]) == ["0", "1"], task  # disjoint
    nodes = {n["index"]: n for n in two["nodes"]}
    assert sorted(nodes) == [0, 1] and nodes[0]["host"] == nodes[1]["host"]
    for i, n in nodes.items():
        assert n["gpus"] == task[i], (i, n)  # ctx.gpus: the task's addresses
        assert n["cuda_visible_devices"] == ",".join(task[i]), (i, n)
        assert n["cuda_device_order"] == "PCI_BUS_ID"

    # gpus_per_node=2: one node, both GPUs
    [node] = r["both"]["nodes"]
    assert r["both"]["task_gpus"] == {"0": ["0", "1"]}
    assert node["gpus"] == ["0", "1"] and node["cuda_visible_devices"] == "0,1"

    # larger than the cluster: refused at once, saying what there is
    refused = r["too_many_nodes"]
    assert refused["error"] and refused["seconds"] < 10, refused
    assert re.search(r"gpus_per_node=1: 3 node\(s\) need 3 task slot\(s\) of 1 CPU\(s\) and 1 "
                     r"GPU\(s\) each at once, and the cluster has 2: executor \S+ on 127\.0\.0\.1:"
                     r" 2 core\(s\), GPUs \[0, 1\] -> 2 slot\(s\)", refused["error"]), refused
    refused = r["too_many_gpus"]
    assert refused["seconds"] < 10 and "gpus_per_node=3: each executor has spark.executor." \
        "resource.gpu.amount=2 GPU(s)" in (refused["error"] or ""), refused

    # inference with spark.task.resource.gpu.amount=1: the right outputs on both paths;
    # each direct-path worker sees one GPU, and no two workers the same one (they
    # are pooled per GPU set); the Arrow UDF workers bind the task's GPU
    inf = r["inference"]
    assert inf["direct_ok"] and inf["udf_ok"], inf
    workers = list(inf["direct_workers"].values())
    assert workers, inf
    seen = [w["CUDA_VISIBLE_DEVICES"] for w in workers]
    assert set(seen) <= {"0", "1"} and len(set(seen)) == len(seen), inf
    assert all(w["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID" for w in workers), inf
    bound = [re.search(r"worker pid (\d+): CUDA_VISIBLE_DEVICES=(\S+) \(the task's GPUs\)",
                       line) for line in inf["udf_log"]]
    assert bound and all(m and m.group(2) in ("0", "1") for m in bound), inf["udf_log"]
    assert len({m.group(1) for m in bound}) == len(bound), inf["udf_log"]  # a worker per task


def _real_gpu_reason() -> str:
    """Why the real-GPU test cannot run here ("" when it can)."""
    if shutil.which("nvidia-smi") is None:
        return "no GPU on this machine (nvidia-smi not found)"
    try:
        subprocess.run(["nvidia-smi", "-L"], check=True, capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"nvidia-smi fails: {exc}"
    probe = subprocess.run([sys.executable, "-c", "import tensorflow as tf; "
                            "print(len(tf.config.list_physical_devices('GPU')))"],
                           capture_output=True, text=True, timeout=300)
    if probe.returncode != 0 or probe.stdout.strip().splitlines()[-1:] in ([], ["0"]):
        return ("this TensorFlow sees no GPU (requirements.txt pins tensorflow-cpu; a GPU "
                "machine needs tensorflow[and-cuda])")
    return ""


def test_main_job_on_a_real_gpu(tmp_path):
    reason = _real_gpu_reason()
    if reason:
        pytest.skip(reason)
    r = _gpu_job(tmp_path, "real", timeout=1500)
    [node] = r["one"]["nodes"]
    assert node["gpus"] == r["one"]["task_gpus"]["0"] and len(node["gpus"]) == 1
    assert node["cuda_visible_devices"] == node["gpus"][0]
    assert len(node["tf_gpus"]) == 1, node  # TensorFlow sees exactly the assigned GPU
    job = r["main_job"]
    assert job["rc"] == 0 and "RESULT demo mode=spark" in job["tail"], job["tail"]
