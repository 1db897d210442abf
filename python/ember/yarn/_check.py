"""Spark-on-YARN settings (:func:`spark_conf`) and the environment check
(``python -m ember yarn check``, :func:`check`), as tf-yarn's
``check_hadoop_env``.  Re-exported by :mod:`ember.yarn`.

``check()`` verifies, in order: ``HADOOP_CONF_DIR`` and its site files
(fs.defaultFS, the ResourceManager address), an HDFS write / read / rename /
delete through Ember's WebHDFS client, the ResourceManager's REST API
(running NodeManagers), and a one-container round trip: a Spark-on-YARN
application with one executor whose task, inside its YARN container, imports
Ember and writes a file to HDFS that the check then reads back.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from typing import Any, Dict, List, NamedTuple, Optional

from ember import hdfs
from ember.yarn import _rest


class Step(NamedTuple):
    name: str
    ok: bool
    detail: str


def spark_conf(executors: int = 2, executor_memory: str = "512m",
               memory_overhead: str = "1536m", python: Optional[str] = None,
               java_home: Optional[str] = None, local_jars: bool = True) -> Dict[str, str]:
    """``spark.*`` settings for Ember on Spark on YARN (client mode).

    ``local_jars`` points ``spark.yarn.jars`` at this pyspark's jars as
    ``local:`` files (present on every NodeManager host: no ~400 MB upload per
    application); ``python`` (default: this interpreter) must exist on every
    node (or pass ``./environment/bin/python`` with ``spark.archives``); a
    session created from Python (not spark-submit) takes the workers'
    interpreter from ``PYSPARK_PYTHON`` instead: set that too;
    ``memory_overhead`` covers the Python worker and the Ember node
    (TensorFlow) beside each executor JVM."""
    conf = {
        "spark.submit.deployMode": "client",
        "spark.executor.instances": str(executors),
        "spark.executor.cores": "1",
        "spark.executor.memory": executor_memory,
        "spark.executor.memoryOverhead": memory_overhead,
        "spark.yarn.am.memory": "512m",
        "spark.pyspark.python": python or sys.executable,
        "spark.scheduler.minRegisteredResourcesRatio": "1.0",
        "spark.scheduler.maxRegisteredResourcesWaitingTime": "300s",
    }
    jh = java_home or os.environ.get("JAVA_HOME")
    if not jh and shutil.which("java"):
        jh = os.path.dirname(os.path.dirname(os.path.realpath(shutil.which("java") or "")))
    if jh:
        conf["spark.yarn.appMasterEnv.JAVA_HOME"] = jh
        conf["spark.executorEnv.JAVA_HOME"] = jh
    if os.environ.get("HADOOP_CONF_DIR"):
        conf["spark.executorEnv.HADOOP_CONF_DIR"] = os.environ["HADOOP_CONF_DIR"]
    if local_jars:
        import pyspark
        conf["spark.yarn.jars"] = f"local:{os.path.dirname(pyspark.__file__)}/jars/*"
    return conf


def _rm_web(conf_dir: str) -> Optional[str]:
    props = hdfs._conf_props(os.path.join(conf_dir, "yarn-site.xml"))
    addr = props.get("yarn.resourcemanager.webapp.address")
    if not addr and props.get("yarn.resourcemanager.hostname"):
        addr = props["yarn.resourcemanager.hostname"] + ":8088"
    return f"http://{addr}" if addr else None


def _container_probe(marker: str) -> int:
    """Runs in a fresh process: a 1-executor Spark-on-YARN app whose task
    writes ``marker`` on HDFS from inside its container."""
    from pyspark.sql import SparkSession

    # the Python workers' interpreter: PySpark takes it from PYSPARK_PYTHON
    # (spark.pyspark.python only counts for spark-submit)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    conf = spark_conf(executors=1, memory_overhead="384m")
    b = SparkSession.builder.master("yarn").appName("ember-yarn-check")
    for k, v in conf.items():
        b = b.config(k, v)
    spark = b.config("spark.ui.enabled", "false").config("spark.yarn.maxAppAttempts", "1") \
        .getOrCreate()
    try:
        def probe(_: Any) -> Any:
            import socket

            from ember import hdfs as h
            info = {"container": os.environ.get("CONTAINER_ID", ""),
                    "host": socket.gethostname(), "python": sys.executable}
            h.write_bytes(marker, json.dumps(info).encode())
            yield info["container"]

        got = spark.sparkContext.parallelize([0], 1).mapPartitions(probe).collect()
        # the probe's answer to the check that started it, read from stdout
        sys.stdout.write(json.dumps({"app_id": spark.sparkContext.applicationId,
                                     "container": got[0]}) + "\n")
    finally:
        spark.stop()
    return 0


def check(conf_dir: Optional[str] = None, container: bool = True,
          timeout: float = 600.0) -> List[Step]:
    """Runs the checks (see the module docstring); stops at the first failure."""
    steps: List[Step] = []
    d = conf_dir or os.environ.get("HADOOP_CONF_DIR")
    if not d or not os.path.isdir(d):
        steps.append(Step("HADOOP_CONF_DIR", False,
                          f"not set or not a directory: {d!r} (export HADOOP_CONF_DIR=...)"))
        return steps
    missing = [f for f in ("core-site.xml", "hdfs-site.xml", "yarn-site.xml")
               if not os.path.isfile(os.path.join(d, f))]
    fs = hdfs.default_fs(d)
    rm = hdfs._conf_props(os.path.join(d, "yarn-site.xml")).get("yarn.resourcemanager.address")
    ok = not missing and fs.startswith("hdfs://") and bool(rm)
    steps.append(Step("HADOOP_CONF_DIR", ok,
                      f"{d}: fs.defaultFS={fs}, yarn.resourcemanager.address={rm}"
                      + (f"; missing {', '.join(missing)}" if missing else "")))
    if not ok:
        return steps
    os.environ["HADOOP_CONF_DIR"] = d
    base = f"{fs}/tmp/ember-check-{uuid.uuid4().hex[:12]}"
    try:
        payload = os.urandom(3 << 20)
        t = time.monotonic()
        hdfs.write_bytes(base + "/a.bin", payload)
        hdfs.rename(base + "/a.bin", base + "/b.bin")
        back = hdfs.read_bytes(base + "/b.bin")
        if back != payload:
            raise RuntimeError(f"read back {len(back)} bytes that differ from the "
                               f"{len(payload)} written")
        steps.append(Step("HDFS", True, f"wrote, renamed and read back 3 MiB under {base} "
                                        f"in {time.monotonic() - t:.2f} s"))
    except Exception as e:
        steps.append(Step("HDFS", False, f"{type(e).__name__}: {e}"))
        return steps
    try:
        web = _rm_web(d)
        reply = _rest.http("GET", f"{web}/ws/v1/cluster/nodes?states=RUNNING",
                           auth=_rest.GridAuth(d))[1]
        nodes = (json.loads(reply).get("nodes") or {}).get("node") or []
        steps.append(Step("YARN", bool(nodes),
                          f"ResourceManager {web}: {len(nodes)} running NodeManager(s)"))
        if not nodes:
            return steps
    except Exception as e:
        steps.append(Step("YARN", False, f"ResourceManager REST API: {type(e).__name__}: {e}"))
        return steps
    try:
        if container:
            marker = base + "/container.json"
            p = subprocess.run([sys.executable, "-m", "ember.yarn._check", "_probe", marker],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               timeout=timeout)
            if p.returncode != 0:
                steps.append(Step("container", False, "Spark-on-YARN probe failed:\n"
                                  + p.stderr[-3000:]))
                return steps
            info = json.loads(hdfs.read_bytes(marker))
            app = json.loads(p.stdout.strip().splitlines()[-1])
            steps.append(Step("container", info["container"].startswith("container_"),
                              f"{app['app_id']}: {info['container']} on {info['host']} "
                              f"({info['python']}) wrote {marker}"))
    except Exception as e:
        steps.append(Step("container", False, f"{type(e).__name__}: {e}"))
    finally:
        try:
            hdfs.delete(base, recursive=True)
        except Exception:
            pass
    return steps


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "_probe":
        sys.exit(_container_probe(sys.argv[2]))
    sys.exit("usage: python -m ember yarn check  (this module's own entry is internal)")
