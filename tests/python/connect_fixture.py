"""The shared Spark Connect server of the tests (``connect_server``): pyspark's
``SparkConnectServer`` (from its ``spark-connect`` jar; pyspark ships no
``start-connect-server.sh``) started with ``spark-submit --class`` against
``local[4]``, once per pytest worker that asks for it.  Clients connect to
``sc://127.0.0.1:<port>`` from processes of their own (no JVM there):
:func:`run_client` runs one of ``connect_client.py``'s scenarios."""

from __future__ import annotations

import glob
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any, Dict, Iterator

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ConnectServer:
    def __init__(self, root: str, master: str = "local[4]") -> None:
        import pyspark

        self.spark_home = os.path.dirname(pyspark.__file__)
        self.root, self.master = root, master
        self.port = _free_port()
        self.url = f"sc://127.0.0.1:{self.port}"
        self.log_path = os.path.join(root, "connect-server.log")
        self.proc: "subprocess.Popen[bytes] | None" = None

    def server_jar(self) -> "str | None":
        """pyspark's spark-connect jar (pip's pyspark ships it from 4.0 on), or None."""
        jars = glob.glob(os.path.join(self.spark_home, "jars", "spark-connect_*.jar"))
        return jars[0] if jars else None

    def start(self, timeout: float = 120) -> None:
        jar = self.server_jar()
        if jar is None:
            raise RuntimeError(f"no spark-connect jar under {self.spark_home}/jars")
        # the executors' Python workers (and so the nodes) run this interpreter
        # and import Ember and the tests' node functions from the checkout
        env = dict(os.environ, SPARK_HOME=self.spark_home, SPARK_LOCAL_IP="127.0.0.1",
                   PYSPARK_PYTHON=sys.executable,
                   PYTHONPATH=os.pathsep.join([REPO, HERE]))
        argv = [os.path.join(self.spark_home, "bin", "spark-submit"),
                "--class", "org.apache.spark.sql.connect.service.SparkConnectServer",
                "--master", self.master, "--jars", jar,
                "--conf", f"spark.connect.grpc.binding.port={self.port}",
                "--conf", "spark.connect.grpc.binding.address=127.0.0.1",
                "--conf", "spark.driver.host=127.0.0.1",
                "--conf", "spark.driver.bindAddress=127.0.0.1",
                "--conf", "spark.ui.enabled=false",
                "--conf", "spark.sql.shuffle.partitions=4",
                "--conf", f"spark.pyspark.python={sys.executable}",
                "--conf", f"spark.executorEnv.PYTHONPATH={env['PYTHONPATH']}",
                "--conf", "spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures=1",
                "spark-internal"]
        log = open(self.log_path, "w")
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the Spark Connect server exited with {self.proc.returncode};"
                                   f" its log: {self.log_path}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"the Spark Connect server did not listen in {timeout:.0f} s; its "
                           f"log: {self.log_path}")

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, 15)
            self.proc.wait(20)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)


def skip_without_server_jar(server: ConnectServer) -> None:
    if server.server_jar() is None:
        import pyspark

        pytest.skip(f"pyspark {pyspark.__version__} ships no Spark Connect server "
                    f"(spark-connect_*.jar under {server.spark_home}/jars; pip's pyspark "
                    "has it from 4.0 on)")


def run_client(scenario: str, server: ConnectServer, out: str, timeout: float) -> Dict[str, Any]:
    """Runs ``connect_client.py <scenario>`` against ``server`` in a process of
    its own and returns what it recorded, after checking that it started no
    JVM (no py4j gateway, no java child process)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("PYSPARK_SUBMIT_ARGS", None)
    proc = subprocess.run([sys.executable, os.path.join(HERE, "connect_client.py"), scenario,
                           server.url, out], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=REPO)
    path = os.path.join(out, f"{scenario}.json")
    assert proc.returncode == 0 and os.path.exists(path), \
        f"client exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}" \
        f"\n(server log: {server.log_path})"
    with open(path) as f:
        record = json.load(f)
    assert record["gateway"] is False and record["java_children"] == [], record
    return dict(record)


@pytest.fixture(scope="session")
def connect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConnectServer]:
    server = ConnectServer(str(tmp_path_factory.mktemp("connect")))
    skip_without_server_jar(server)
    try:
        server.start()
        yield server
    finally:
        server.stop()
