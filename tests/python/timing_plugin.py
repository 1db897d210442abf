"""Where the test suite's time goes: a pytest plugin for ``docs/testing.md``.

Loaded with ``-p timing_plugin`` and given a report path in
``EMBER_TEST_PROFILE``; without the variable it does nothing.  While the
suite runs, a thread samples the machine twice a second: CPU busy and idle
(``/proc/stat``) and every process started since the last sample, sorted
into the kinds a test pays for (a Spark driver, executor, standalone master
or worker, the mini Hadoop, a YARN ApplicationMaster, an Ember node, the
MLflow server, ...).  At the end it writes, per test module: wall time, the
share of both cores that was busy, and how many processes of each kind
started; then the whole run's totals.  A JSON copy goes beside the text.

    EMBER_TEST_PROFILE=build/test-profile.txt .venv/bin/python -m pytest \\
        -p timing_plugin tests/python

Processes that live under half a second can be missed; the long-lived ones
(JVMs, nodes) are what this counts.
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time
from typing import Dict, List, Optional, Tuple

import pytest

#: (substring of the command line, kind), first match wins
KINDS: List[Tuple[str, str]] = [
    ("org.apache.spark.deploy.SparkSubmit", "spark driver JVM"),
    ("CoarseGrainedExecutorBackend", "spark executor JVM"),
    ("org.apache.spark.deploy.master.Master", "spark standalone master"),
    ("org.apache.spark.deploy.worker.Worker", "spark standalone worker"),
    ("org.apache.spark.deploy.yarn.ExecutorLauncher", "YARN AM (Spark)"),
    ("org.apache.spark.deploy.yarn.ApplicationMaster", "YARN AM (Spark)"),
    ("org.ember.yarn", "YARN AM (run_on_yarn)"),
    ("EmberAppMaster", "YARN AM (run_on_yarn)"),
    ("org.ember.hadoop.MiniHadoop", "mini HDFS+YARN"),
    ("SparkConnectServer", "Spark Connect server"),
    ("ember._trainer", "ember node"),
    # the direct path's launcher; a fork server of its workers and the workers
    # it forked (that server's command line names its program)
    ("ember._direct_launcher", "direct-inference worker"),
    ("ember/ml/_direct_worker.py", "direct-inference worker"),
    ("ember.ml._direct_worker", "direct-inference worker"),
    # a fork server, and the nodes (and their watchdogs) it forked
    ("ember._forkserver", "ember node"),
    ("ember.yarn.task", "run_on_yarn task"),
    (" mlflow server", "mlflow server"),
    ("pyspark.daemon", "pyspark daemon"),
    ("ember.spark_daemon", "pyspark daemon"),
    ("-m build", "python -m build"),
    ("mpirun", "mpirun"),
]


def _kind(cmdline: str) -> Optional[str]:
    for needle, kind in KINDS:
        if needle in cmdline:
            return kind
    return None


def _cpu() -> Tuple[int, int]:
    """(busy, total) jiffies of all CPUs so far."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


class _Sampler(threading.Thread):
    def __init__(self) -> None:
        super().__init__(name="ember-test-profile", daemon=True)
        self.seen: set = set()
        self.starts: List[Tuple[float, str]] = []  # (time, kind)
        self.stop_event = threading.Event()
        self._scan(record=False)

    def _scan(self, record: bool) -> None:
        now = time.monotonic()
        for name in os.listdir("/proc"):
            if not name.isdigit() or name in self.seen:
                continue
            self.seen.add(name)
            if not record:
                continue
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            kind = _kind(cmd)
            if kind:
                self.starts.append((now, kind))

    def run(self) -> None:
        while not self.stop_event.wait(0.5):
            self._scan(record=True)


class _Profile:
    def __init__(self, path: str) -> None:
        self.path = path
        self.sampler = _Sampler()
        self.t0 = time.monotonic()
        self.cpu0 = _cpu()
        # module -> [wall seconds, busy jiffies, total jiffies]
        self.modules: Dict[str, List[float]] = collections.defaultdict(lambda: [0.0, 0, 0])
        self.tests: List[Tuple[float, str]] = []
        self.spans: List[Tuple[float, float, str]] = []  # (start, end, module)
        # nodeid -> (start, cpu at start); several at once under pytest-xdist,
        # where a test's busy share is the machine's while it ran
        self._running: Dict[str, Tuple[float, Tuple[int, int]]] = {}

    def start_test(self, nodeid: str) -> None:
        self._running[nodeid] = (time.monotonic(), _cpu())

    def end_test(self, nodeid: str) -> None:
        if nodeid not in self._running:
            return
        t, (b0, a0) = self._running.pop(nodeid)
        b1, a1 = _cpu()
        now = time.monotonic()
        module = nodeid.split("::")[0]
        m = self.modules[module]
        m[0] += now - t
        m[1] += b1 - b0
        m[2] += a1 - a0
        self.tests.append((now - t, nodeid))
        self.spans.append((t, now, module))

    def write(self) -> None:
        self.sampler.stop_event.set()
        self.sampler.join(2)
        wall = time.monotonic() - self.t0
        b1, a1 = _cpu()
        busy_all = (b1 - self.cpu0[0]) / max(1, a1 - self.cpu0[1])
        per_module: Dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        outside: collections.Counter = collections.Counter()
        for t, kind in self.sampler.starts:
            owner = next((m for s, e, m in self.spans if s <= t <= e + 0.5), None)
            (per_module[owner] if owner else outside)[kind] += 1
        totals: collections.Counter = collections.Counter(k for _, k in self.sampler.starts)
        rows = []
        for module, (secs, busy, total) in sorted(self.modules.items(), key=lambda kv: -kv[1][0]):
            rows.append(dict(module=module, seconds=round(secs, 1),
                             busy=round(busy / max(1, total), 2),
                             started=dict(per_module.get(module, {}))))
        report = dict(wall_s=round(wall, 1), busy=round(busy_all, 2), started=dict(totals),
                      modules=rows,
                      slowest=[dict(seconds=round(s, 1), test=n)
                               for s, n in sorted(self.tests, reverse=True)[:40]])
        with open(self.path + ".json", "w") as f:
            json.dump(report, f, indent=1)
        lines = [f"pytest wall {wall:.0f} s, both cores busy {busy_all:.0%} of it",
                 "processes started: " + ", ".join(f"{k} {v}" for k, v in totals.most_common()),
                 "", f"{'seconds':>8} {'busy':>5}  module / processes started"]
        for r in rows:
            started = ", ".join(f"{k} {v}" for k, v in sorted(r["started"].items()))
            lines.append(f"{r['seconds']:8.1f} {r['busy']:5.0%}  {r['module']}"
                         + (f"  [{started}]" if started else ""))
        lines += ["", "slowest tests (setup + call + teardown):"]
        lines += [f"{s['seconds']:8.1f}  {s['test']}" for s in report["slowest"]]
        with open(self.path, "w") as f:
            f.write("\n".join(lines) + "\n")


_profile: Optional[_Profile] = None


def pytest_sessionstart(session: pytest.Session) -> None:
    global _profile
    path = os.environ.get("EMBER_TEST_PROFILE")
    # under pytest-xdist the controller profiles (it sees every test's start
    # and end); its workers do not
    if path and not hasattr(session.config, "workerinput"):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        _profile = _Profile(path)
        _profile.sampler.start()


def pytest_runtest_logstart(nodeid: str, location: object) -> None:
    if _profile:
        _profile.start_test(nodeid)


def pytest_runtest_logfinish(nodeid: str, location: object) -> None:
    if _profile:
        _profile.end_test(nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _profile:
        _profile.write()
