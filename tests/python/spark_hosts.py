"""A Spark standalone cluster on simulated hosts (simcluster.py): the Master
on host ``master``, one 1-core Worker on each worker host, driver programs
on host ``driver``.  Used by test_cluster.py (its ``hosts`` fixture) and by
the benchmarks that run Spark across hosts (bench/train.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Dict, List

import simcluster

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable


class SparkOnHosts:
    """A Spark standalone Master on host ``master`` and a Worker (1 core) on
    each of ``workers``, every daemon binding and advertising its host's
    address; driver programs run on host ``driver``."""

    def __init__(self, sim: simcluster.SimCluster, root: str, workers: List[str]) -> None:
        import pyspark

        self.sim, self.root, self.worker_hosts = sim, root, list(workers)
        self.spark_home = os.path.dirname(pyspark.__file__)
        self.url = "spark://master:7077"
        self.workers: Dict[str, subprocess.Popen] = {}

    def env(self, host: str) -> Dict[str, str]:
        env = self.sim.env_for(host)
        env.update(SPARK_HOME=self.spark_home, PYSPARK_PYTHON=PY,
                   SPARK_WORKER_DIR=os.path.join(self.root, f"work-{host}"),
                   PYTHONUNBUFFERED="1")
        return env

    def _daemon(self, host: str, *args: str) -> subprocess.Popen:
        log = open(os.path.join(self.root, f"{host}.log"), "a")
        return self.sim.popen(host, [os.path.join(self.spark_home, "bin", "spark-class"), *args],
                              stdout=log, stderr=subprocess.STDOUT, env=self.env(host))

    def start(self) -> None:
        self._daemon("master", "org.apache.spark.deploy.master.Master", "--host", "master",
                     "--port", "7077", "--webui-port", "8080")
        for host in self.worker_hosts:
            self.start_worker(host)
        self.wait_workers(len(self.worker_hosts))

    def start_worker(self, host: str) -> None:
        self.workers[host] = self._daemon(
            host, "org.apache.spark.deploy.worker.Worker", "--host", host, "--cores", "1",
            "--memory", "2g", "--webui-port", "8081", self.url)

    def alive_workers(self) -> List[str]:
        probe = ("import json,urllib.request;"
                 "s=json.load(urllib.request.urlopen('http://master:8080/json/',timeout=2));"
                 "print(' '.join(w['host'] for w in s['workers'] if w['state']=='ALIVE'))")
        r = self.sim.run("driver", [PY, "-c", probe], capture_output=True, text=True)
        return r.stdout.split() if r.returncode == 0 else []

    def wait_workers(self, n: int) -> None:
        deadline = time.monotonic() + 120
        while len(self.alive_workers()) < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"fewer than {n} Spark workers alive; logs in {self.root}")
            time.sleep(1)

    def driver(self, argv: List[str], log: str, cwd: str = REPO) -> subprocess.Popen:
        """Starts a driver program on the driver host (stdout+stderr to ``log``)."""
        out = open(os.path.join(self.root, log), "w")
        return self.sim.popen("driver", argv, stdout=out, stderr=subprocess.STDOUT,
                              env=self.env("driver"), cwd=cwd)

    def run_driver(self, argv: List[str], log: str, timeout: float) -> str:
        p = self.driver(argv, log)
        try:
            code = p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            code = "timeout"
        text = open(os.path.join(self.root, log)).read()
        assert code == 0, f"{argv[:3]} exited {code}; its log ends:\n{text[-6000:]}"
        return text
