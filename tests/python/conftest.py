"""Shared fixtures: one Spark session at a time, reused across tests.

``local_spark`` is an embedded ``local[4]`` session.  ``cluster_spark`` is a
real Spark standalone cluster on loopback (one Master and two Workers started
with ``spark-class``, each Worker running its own executor JVM) with a session
connected to it.  Only one SparkContext can live in a process, so asking for
the other kind stops the current one; tests are ordered (below) so that each
kind starts once per process.

``make test`` runs the suite in two pytest-xdist workers, one per core
(``-n 2 --dist loadgroup``).  Each test module belongs to one of two lanes
(:data:`LANES`), and each lane runs in one worker: the modules that need the
mini Hadoop or the simulated hosts, which mostly wait on YARN, daemons and
heartbeats, run beside the ones that keep the cores busy, and each session
fixture (Spark, Hadoop, hosts) starts in one worker only.  docs/testing.md
has the costs behind the split and how to place a new module.
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

from connect_fixture import connect_server  # noqa: F401  (the Spark Connect server)
from hadoop_fixture import hadoop_cluster, kerberized_hadoop, yarn  # noqa: F401  (mini Hadoops)
from jvm_archive import jvm_options_for_tests

from ember._imports import pause_collector_on_heavy_imports

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Every JVM the tests start (Spark drivers, executors and standalone daemons,
# the mini Hadoop and its YARN containers, which inherit its environment, and
# Maven in the packaging tests) gets jvm_archive.jvm_options_for_tests(): the C1
# compiler and the serial collector, and the class-data-sharing archive of
# pyspark's classes that make setup writes.  A JAVA_TOOL_OPTIONS of the
# caller's wins.  Benchmarks never get them.
os.environ.setdefault("JAVA_TOOL_OPTIONS", jvm_options_for_tests())

# Tests that build a model in the test process import TensorFlow or torch
# there: as Ember's nodes do (ember._imports), with the cyclic collector
# paused, what the import made then frozen, so that the collector's later
# full passes (the driver's threads allocate all along) do not go over it.
pause_collector_on_heavy_imports()

# The processes the tests start (nodes, Spark's Python workers, inference
# workers, YARN tasks) write the byte code of what they import, as the
# Makefile has them do (its `unexport PYTHONDONTWRITEBYTECODE`), also when
# pytest is run directly from an environment that sets the variable.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

#: The xdist lane of each test module that does not run in the default lane
#: ("spark": local and standalone Spark sessions, the C engine's tests).
#: "hadoop": the mini HDFS + YARN, and the simulated hosts (test_cluster.py).
LANES = {m: "hadoop" for m in (
    "test_hadoop", "test_hdfs_paths", "test_hdfs_fmnist", "test_spark_yarn", "test_yarn_run",
    "test_yarn_experiments", "test_packaging", "test_mlflow",
    "test_cluster",
    # its own standalone cluster with discovered GPUs (about 2.5 min): in the
    # spark lane, that lane ended 7.5 min after this one (fresh clone, 2026-11-29)
    "test_gpu",
    # local Spark only, about 85 s: the spark lane still ended 408 s after
    # this one (fresh clone of 1bd95f8, 2026-11-29); the direct path's shared
    # inference workers since then shorten that lane by about 100 s more
    "test_spark_local", "test_collective_spark")}
#: A test of another module that uses the mini Hadoop runs in the hadoop lane
#: too, so that one worker starts it (the rest of its module may run in the
#: spark lane, which balances the lanes).
HADOOP_FIXTURE = "hadoop_cluster"
#: Modules that use the standalone cluster (``cluster_spark``) run last in
#: their lane, so that each process starts the local session once and the
#: standalone one once.
STANDALONE_LAST = ("test_compat_tfos", "test_standalone")


#: make test (tests/stages.py) sets this: the file the controller appends a
#: line to when a worker has run its last test, so that the next stage can
#: start on the core that lane leaves idle while the other lane finishes.
LANE_DONE_FILE = "EMBER_LANE_DONE_FILE"


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: a venv without it runs serially
def pytest_testnodedown(node: Any, error: Any) -> None:
    path = os.environ.get(LANE_DONE_FILE)
    if path:
        with open(path, "a") as f:
            f.write(f"{node.gateway.id} {time.time():.1f}\n")


def _module_name(item: Any) -> str:
    return os.path.splitext(os.path.basename(str(item.fspath)))[0]


def pytest_configure(config: Any) -> None:
    # known without pytest-xdist too (the PyTorch venv runs the suite serially)
    config.addinivalue_line("markers", "xdist_group(name): the pytest-xdist lane of a test")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config: Any, items: List[Any]) -> None:
    def rank(item: Any) -> int:
        name = _module_name(item)
        return STANDALONE_LAST.index(name) + 1 if name in STANDALONE_LAST else 0

    items.sort(key=rank)  # stable: file order otherwise
    for item in items:
        lane = "hadoop" if HADOOP_FIXTURE in getattr(item, "fixturenames", ()) else \
            LANES.get(_module_name(item), "spark")
        item.add_marker(pytest.mark.xdist_group(lane))


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
        self.release()
        if kind == "local":
            self.spark = _base_builder("ember-tests").master("local[4]").getOrCreate()
        else:
            self.spark = (_base_builder("ember-tests-standalone")
                          .master(self.standalone_cluster(tmp_root).url)
                          .config("spark.executor.memory", "768m")
                          .config("spark.executor.cores", "1")
                          .config("spark.cores.max", "2")
                          .getOrCreate())
            self.standalone_cluster(tmp_root).wait_executors(self.spark, 2)
        self.spark.sparkContext.setLogLevel("WARN")
        self.kind = kind
        return self.spark

    def standalone_cluster(self, tmp_root: str) -> "Standalone":
        """The standalone Master and Workers, started on first use."""
        if self.standalone is None:
            self.standalone = Standalone(tmp_root)
            self.standalone.start()
        return self.standalone

    def release(self) -> None:
        """Stops this process's session (its executors free their Workers'
        cores); the next get() starts one again."""
        if self.spark is not None:
            self.spark.stop()
        self.spark, self.kind = None, None

    def close(self) -> None:
        self.release()
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

    def _spawn(self, name: str, *args: str, worker_opts: str = "", master_opts: str = "") -> None:
        env = dict(os.environ, SPARK_HOME=self.spark_home, SPARK_LOCAL_IP="127.0.0.1",
                   SPARK_WORKER_DIR=os.path.join(self.root, "work"),
                   PYSPARK_PYTHON=sys.executable)
        if worker_opts:  # read by spark-class for the Worker class
            env["SPARK_WORKER_OPTS"] = worker_opts
        if master_opts:  # and this for the Master class
            env["SPARK_MASTER_OPTS"] = master_opts
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
        """Starts the Master, then the Workers once it serves, and waits until
        every Worker is ALIVE.  The ports come from :func:`free_port`, so
        another process can take one before the Master binds it: the Master
        then exits at once (``spark.port.maxRetries=0``: Spark would otherwise
        move to the next port, where the Workers do not look) and starts again
        on new ports."""
        for _ in range(3):
            if self._start_master():
                break
            self.stop()
            self.procs = []
            self.port, self.ui_port = free_port(), free_port()
            self.url = f"spark://127.0.0.1:{self.port}"
        else:
            raise RuntimeError(f"standalone master did not start in 3 tries; logs in {self.root}")
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
            state = self._master_state()
            if state is not None and sum(w.get("state") == "ALIVE"
                                         for w in state.get("workers", [])) >= self.workers:
                return
            time.sleep(0.5)
        raise RuntimeError(f"standalone cluster did not start; logs in {self.root}")

    def _master_state(self) -> Optional[Dict[str, Any]]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/json/",
                                        timeout=5) as r:
                return json.load(r)
        except (OSError, ValueError):
            return None

    def _start_master(self) -> bool:
        """True once the Master serves its status; False if it exited first."""
        self._spawn("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                    "--port", str(self.port), "--webui-port", str(self.ui_port),
                    # no REST submission server: its fixed port 6066 would be
                    # taken by the first of two masters, failing the second
                    master_opts="-Dspark.port.maxRetries=0 -Dspark.master.rest.enabled=false")
        master = self.procs[-1]
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if master.poll() is not None:
                return False
            if self._master_state() is not None:
                return True
            time.sleep(0.5)
        raise RuntimeError(f"standalone master did not serve in 90 s; logs in {self.root}")

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


def wait_gone(pids: Sequence[int], timeout: float = 15.0) -> List[int]:
    """Waits up to ``timeout`` s until none of ``pids`` runs (gone, or a
    zombie not reaped yet); returns those still running."""
    def running(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    deadline = time.monotonic() + timeout
    alive = [p for p in pids if running(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if running(p)]
    return alive


def forked_direct_worker(launcher: int) -> Optional[int]:
    """pid of the worker a direct-path launcher (``ember._direct_launcher``)
    had forked, or None: the child of a fork server of
    ember.ml._direct_worker whose stderr is the launcher's (the worker's log)."""
    try:
        log = os.readlink(f"/proc/{launcher}/fd/2")
    except OSError:
        return None
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = f.read().rsplit(")", 1)[1].split()[1]
            with open(f"/proc/{ppid}/cmdline", "rb") as f:
                parent = f.read().split(b"\0")
            if b"ember._forkserver" in parent and b"ember.ml._direct_worker" in parent \
                    and os.readlink(f"/proc/{d}/fd/2") == log:
                return int(d)
        except (OSError, ValueError):
            continue
    return None


def read_json_files(directory: str) -> List[Dict[str, Any]]:
    out = []
    for name in sorted(os.listdir(directory)):
        if name.endswith(".json"):
            with open(os.path.join(directory, name)) as f:
                out.append(json.load(f))
    return out
