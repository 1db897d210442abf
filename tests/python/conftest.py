"""Shared fixtures: one Spark session at a time, reused across tests.

``local_spark`` is an embedded ``local[4]`` session.  ``cluster_spark`` is a
real Spark standalone cluster on loopback (one Master and two Workers started
with ``spark-class``, each Worker running its own executor JVM) with a session
connected to it.  Only one SparkContext can live in a process, so asking for
the other kind stops the current one; test files are ordered so that this
happens once.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any, Dict, Iterator, List, Optional, Sequence

import pytest

from hadoop_fixture import hadoop_cluster, yarn  # noqa: F401  (HDFS + YARN mini clusters)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _base_builder(app: str) -> Any:
    from pyspark.sql import SparkSession

    # executors' Python workers (and so the nodes) run this interpreter
    os.environ["PYSPARK_PYTHON"] = sys.executable

    return (SparkSession.builder.appName(app)
            .config("spark.driver.host", "127.0.0.1")
            .config("spark.driver.bindAddress", "127.0.0.1")
            .config("spark.ui.enabled", "false")
            .config("spark.sql.shuffle.partitions", "4")
            .config("spark.pyspark.python", sys.executable)
            # fail a barrier stage that cannot get its slots at once, not after 40 tries
            .config("spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures", "1")
            .config("spark.executorEnv.PYTHONPATH",
                    os.pathsep.join([REPO, os.path.join(REPO, "tests", "python")])))


class _Sessions:
    def __init__(self) -> None:
        self.kind: Optional[str] = None
        self.spark: Any = None
        self.standalone: Optional["Standalone"] = None

    def get(self, kind: str, tmp_root: str) -> Any:
        if self.kind == kind:
            return self.spark
        if self.spark is not None:
            self.spark.stop()
            self.spark = None
        if kind == "local":
            self.spark = _base_builder("ember-tests").master("local[4]").getOrCreate()
        else:
            if self.standalone is None:
                self.standalone = Standalone(tmp_root)
                self.standalone.start()
            self.spark = (_base_builder("ember-tests-standalone")
                          .master(self.standalone.url)
                          .config("spark.executor.memory", "768m")
                          .config("spark.executor.cores", "1")
                          .config("spark.cores.max", "2")
                          .getOrCreate())
            self.standalone.wait_executors(self.spark, 2)
        self.spark.sparkContext.setLogLevel("WARN")
        self.kind = kind
        return self.spark

    def close(self) -> None:
        if self.spark is not None:
            self.spark.stop()
        if self.standalone is not None:
            self.standalone.stop()


class Standalone:
    """A Spark standalone Master and ``workers`` Workers (``cores`` each) on 127.0.0.1.

    ``gpus``: per Worker, the GPU addresses it advertises (Spark's resource
    scheduling: ``spark.worker.resource.gpu.amount`` and a discovery script
    printing them; the addresses need no real GPU behind them)."""

    def __init__(self, root: str, workers: int = 2, cores: int = 1, memory: str = "1g",
                 gpus: Sequence[Sequence[str]] = ()) -> None:
        import pyspark

        self.spark_home = os.path.dirname(pyspark.__file__)
        self.root = root
        self.workers, self.cores, self.memory = workers, cores, memory
        self.gpus = [list(g) for g in gpus]
        self.port = free_port()
        self.ui_port = free_port()
        self.url = f"spark://127.0.0.1:{self.port}"
        self.procs: List[subprocess.Popen] = []

    def _spawn(self, name: str, *args: str, worker_opts: str = "") -> None:
        env = dict(os.environ, SPARK_HOME=self.spark_home, SPARK_LOCAL_IP="127.0.0.1",
                   SPARK_WORKER_DIR=os.path.join(self.root, "work"),
                   PYSPARK_PYTHON=sys.executable)
        if worker_opts:  # read by spark-class for the Worker class
            env["SPARK_WORKER_OPTS"] = worker_opts
        log = open(os.path.join(self.root, f"{name}.log"), "w")
        self.procs.append(subprocess.Popen(
            [os.path.join(self.spark_home, "bin", "spark-class"), *args],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))

    def discovery_script(self, addresses: Sequence[str]) -> str:
        """A GPU discovery script (Spark's format) that reports ``addresses``."""
        path = os.path.join(self.root, f"gpus-{'-'.join(addresses) or 'none'}.sh")
        with open(path, "w") as f:
            f.write("#!/bin/sh\necho '" + json.dumps({"name": "gpu", "addresses": list(addresses)})
                    + "'\n")
        os.chmod(path, 0o755)
        return path

    def start(self) -> None:
        self._spawn("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                    "--port", str(self.port), "--webui-port", str(self.ui_port))
        for i in range(self.workers):
            opts = ""
            if i < len(self.gpus):
                opts = (f"-Dspark.worker.resource.gpu.amount={len(self.gpus[i])} "
                        "-Dspark.worker.resource.gpu.discoveryScript="
                        + self.discovery_script(self.gpus[i]))
            self._spawn(f"worker{i}", "org.apache.spark.deploy.worker.Worker", "--host",
                        "127.0.0.1", "--webui-port", str(free_port()), "--cores",
                        str(self.cores), "--memory", self.memory, self.url, worker_opts=opts)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/json/") as r:
                    state = json.load(r)
                if sum(w.get("state") == "ALIVE" for w in state.get("workers", [])) \
                        >= self.workers:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"standalone cluster did not start; logs in {self.root}")

    def wait_executors(self, spark: Any, n: int) -> None:
        sc = spark.sparkContext
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            # the driver itself is listed as one "executor" in the status tracker
            if sc._jsc.sc().getExecutorMemoryStatus().size() - 1 >= n:
                return
            time.sleep(0.5)
        raise RuntimeError(f"fewer than {n} executors registered; logs in {self.root}")

    def stop(self) -> None:
        for p in self.procs:
            try:
                os.killpg(p.pid, 15)
            except ProcessLookupError:
                pass
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)


@pytest.fixture(scope="session")
def _sessions(tmp_path_factory: Any) -> Iterator[_Sessions]:
    s = _Sessions()
    s.root = str(tmp_path_factory.mktemp("spark"))  # type: ignore[attr-defined]
    yield s
    s.close()


@pytest.fixture
def local_spark(_sessions: _Sessions) -> Any:
    return _sessions.get("local", _sessions.root)  # type: ignore[attr-defined]


@pytest.fixture
def cluster_spark(_sessions: _Sessions) -> Any:
    return _sessions.get("standalone", _sessions.root)  # type: ignore[attr-defined]


def signal_node_when_ready(path: str, holder: Dict[str, Any], sig: int,
                           delay: float = 1.0, index: int = 1, nodes: int = 2) -> None:
    """Waits (up to 120 s) until ``nodes`` nodes have written their report
    into ``path``, then, ``delay`` s later, sends ``sig`` to node ``index``;
    ``holder`` gets the node's report as "victim" and the time as
    "signalled_at" (time.monotonic)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        infos = read_json_files(path)
        if len(infos) == nodes:
            time.sleep(delay)
            victim = next(i for i in infos if i["index"] == index)
            holder["victim"] = victim
            holder["signalled_at"] = time.monotonic()
            os.kill(victim["pid"], sig)
            return
        time.sleep(0.1)


def read_json_files(directory: str) -> List[Dict[str, Any]]:
    out = []
    for name in sorted(os.listdir(directory)):
        if name.endswith(".json"):
            with open(os.path.join(directory, name)) as f:
                out.append(json.load(f))
    return out
