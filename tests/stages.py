"""make test: set up this machine and run every test, the independent stages at once.

Run by ``make test`` with the system's python3 (the standard library only:
the venv does not exist yet when it starts).  Each stage is a command; a
stage starts as soon as the stages it needs have passed, so stages that need
different things overlap: the C tests and fuzzers build and run while uv,
pip and Maven set up the Python side; the main suite keeps both cores busy by
itself (two pytest-xdist workers); the Spark 3.5 compatibility subset and
six of the smoke benchmarks start once its first lane ends, and the type
check once either of them is done.  Every line a stage prints is shown with
its name and the run's clock (minutes:seconds) in front, and kept in
build/test-logs/<stage>.log.

At the end: each stage's duration, and a warning when the whole run took
longer than WARN_MINUTES, so that growth is seen long before CI's limit (90
minutes; the suite's ceiling is 45).  The exit status is 0 only if every
stage passed; a stage whose prerequisite failed is not run, and says so.
Each failed stage's failures (pytest's FAILED lines, else its log's last
lines) are repeated after the table, where a truncated CI log still has them.

    python3 tests/stages.py                 # what make test runs
    python3 tests/stages.py --only pytest   # one stage and what it needs
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from typing import Dict, List, NamedTuple, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOGS = os.path.join(REPO, "build", "test-logs")
WARN_MINUTES = 40
FAILURE_LINES = 25  #: lines of a failed stage's log repeated at the end
MAKE = ["make", "--no-print-directory"]
PY = os.path.join(REPO, ".venv", "bin", "python")
#: tests/python/conftest.py appends a line here when a pytest-xdist worker
#: has run its last test (pytest_testnodedown)
LANE_DONE = os.path.join(LOGS, "pytest-lane-done")

#: The Makefile unexports PYTHONDONTWRITEBYTECODE (every stage's Python writes
#: the byte code of what it imports) and passes on whether its caller had set
#: it, which changes how long the suite takes (docs/testing.md).
BYTE_CODE_NOTE = ("byte code: written by every stage; the caller's environment "
                  + ("set PYTHONDONTWRITEBYTECODE, which make test unsets"
                     if os.environ.get("EMBER_CALLER_DONTWRITEBYTECODE")
                     or os.environ.get("PYTHONDONTWRITEBYTECODE")
                     else "did not set PYTHONDONTWRITEBYTECODE"))

#: The main job runs on simulated hosts in test_cluster.py; where those hosts
#: cannot be made (not root), demo-quick runs it on this host instead.
MAIN_JOB = ("PYTHONPATH=tests/python .venv/bin/python -c 'import simcluster, sys; "
            "sys.exit(3 if simcluster.available() is None else 0)'; rc=$?; "
            "if [ $rc -eq 3 ]; then echo 'the main job ran on simulated hosts (test_cluster.py)'; "
            "else make --no-print-directory demo-quick; fi")


class Stage(NamedTuple):
    name: str
    command: Sequence[str]
    needs: Sequence[str] = ()  #: stages that must have passed
    after: Sequence[str] = ()  #: stages that must have ended (passed or not)
    what: str = ""
    #: "pytest" in ``after`` counts as ended once pytest has a lane done
    #: (LANE_DONE: a core is idle while the other lane ends)
    on_lane_done: bool = False
    #: one of these must have ended too (whichever frees a core first)
    after_any: Sequence[str] = ()


STAGES: List[Stage] = [
    Stage("apt", MAKE + ["apt"], what="Debian packages (a no-op when installed)"),
    # -j2: pip for the venvs and the C library at once (Maven runs once at
    # a time: the Makefile builds the jars before the mini Hadoop)
    Stage("setup", MAKE + ["-j2", "setup", "hadoop", "test-jvm-archive", "warm-imports"], ("apt",),
          what="venvs, libember, the extension and its jars, the mini Hadoop, "
               "the tests' JVM archive, the byte code of the heavy imports"),
    # build/san and build/fuzz are their own objects: they build beside setup
    Stage("c-tests", MAKE + ["-j2", "test-c"], ("apt",),
          what="C tests under ASan/UBSan"),
    # the corpus replay is the regression test; make fuzz fuzzes 30 s each
    Stage("fuzz", MAKE + ["fuzz", "FUZZ_SECONDS=5"], ("apt",), ("c-tests",),
          what="each libFuzzer harness: its corpus, then 5 s of fuzzing"),
    Stage("c-install", MAKE + ["test-c-install"], ("setup",),
          what="libember installed; examples/c built through pkg-config"),
    Stage("pytest", ["env", f"EMBER_LANE_DONE_FILE={LANE_DONE}",  # conftest.LANE_DONE_FILE
                     PY, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup",
                     "--durations=20", "--junitxml=build/test-logs/pytest-junit.xml",
                     "tests/python"], ("setup",), ("c-install",),
          what="the Python suite in two workers (tests/python/conftest.py: LANES)"),
    # its packages once the C tests and fuzzers are done (since the set-up
    # takes uv and ~/.m2, 212 s instead of 385, that is beside pytest's
    # start); its ember (the jar and the op compiled) once the set-up has
    # passed; its tests once the first pytest lane ends
    Stage("compat-venv", MAKE + ["venv-compat-deps"], ("apt",), ("fuzz",),
          what="the Spark 3.5 / TensorFlow 2.20 venv's packages"),
    Stage("compat-setup", MAKE + ["venv-compat"], ("setup", "compat-venv"),
          what="ember in the Spark 3.5 / TensorFlow 2.20 venv"),
    # compat and bench-smoke once the first pytest lane ends (the lanes end
    # up to minutes apart): three at once on two cores until the other lane
    # ends, rather than bench-smoke alone on one core once it has (120 s of
    # the run's end with the other core idle: fresh clone of aec6652,
    # 2026-11-29); typecheck once either of them is done
    Stage("compat", MAKE + ["test-compat"], ("compat-setup",), ("pytest",),
          what="the compatibility subset on pyspark 3.5 and TensorFlow 2.20",
          on_lane_done=True),
    # the benchmarks that start no cluster per side (bench/smoke.py:
    # Bench.in_make_test; make bench-smoke runs all ten)
    Stage("bench-smoke", MAKE + ["bench-smoke", "BENCH_SMOKE_ARGS=--make-test"], ("setup",),
          ("pytest",), what="six of the ten benchmarks at a tiny size", on_lane_done=True),
    Stage("typecheck", MAKE + ["typecheck"], ("setup",), ("pytest",),
          what="mypy over python/ember, stubtest of _ember.pyi", on_lane_done=True,
          after_any=("compat", "bench-smoke")),
    Stage("main-job", ["bash", "-c", MAIN_JOB], ("setup",), ("pytest",),
          what="the main job, where test_cluster.py could not run it"),
]


class Result(NamedTuple):
    status: str  # "ok", "FAILED (exit N)", "not run (...)"
    seconds: float


class Runner:
    def __init__(self, stages: Sequence[Stage]) -> None:
        self.stages = {s.name: s for s in stages}
        self.results: Dict[str, Result] = {}
        self.started: Dict[str, float] = {}
        self.print_lock = threading.Lock()
        self.changed = threading.Condition()
        self.t0 = time.monotonic()

    def say(self, stage: str, line: str) -> None:
        with self.print_lock:
            minutes, seconds = divmod(int(time.monotonic() - self.t0), 60)
            sys.stdout.write(f"[{stage} {minutes:02d}:{seconds:02d}] {line}\n")
            sys.stdout.flush()

    def _run(self, stage: Stage) -> None:
        start = time.monotonic()
        self.say(stage.name, f"start: {stage.what}")
        log_path = os.path.join(LOGS, f"{stage.name}.log")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(stage.command, cwd=REPO, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, text=True, errors="replace", bufsize=1)
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                self.say(stage.name, line.rstrip("\n"))
            code = proc.wait()
        seconds = time.monotonic() - start
        status = "ok" if code == 0 else f"FAILED (exit {code})"
        self.say(stage.name, f"{status} in {seconds:.0f} s (log: {os.path.relpath(log_path, REPO)})")
        with self.changed:
            self.results[stage.name] = Result(status, seconds)
            self.changed.notify_all()

    def run(self) -> int:
        os.makedirs(LOGS, exist_ok=True)
        if os.path.exists(LANE_DONE):
            os.remove(LANE_DONE)
        self.t0 = t0 = time.monotonic()
        threads: List[threading.Thread] = []
        with self.changed:
            while len(self.results) < len(self.stages):
                for s in self.stages.values():
                    if s.name in self.results or s.name in self.started:
                        continue
                    blocked = [d for d in s.needs
                               if d in self.results and self.results[d].status != "ok"]
                    if blocked:
                        self.results[s.name] = Result(f"not run ({blocked[0]} failed)", 0.0)
                        self.say(s.name, self.results[s.name].status)
                        continue
                    lane_free = s.on_lane_done and os.path.exists(LANE_DONE)
                    ready = all(d in self.results or (d == "pytest" and lane_free)
                                for d in (*s.needs, *s.after)) and (
                        not s.after_any or any(d in self.results for d in s.after_any))
                    if ready:
                        self.started[s.name] = time.monotonic()
                        t = threading.Thread(target=self._run, args=(s,), daemon=True)
                        threads.append(t)
                        t.start()
                if len(self.results) < len(self.stages):
                    self.changed.wait(1.0)
        for t in threads:
            t.join()
        return self.report(time.monotonic() - t0)

    def report(self, total: float) -> int:
        print(f"\nmake test stages (logs in {os.path.relpath(LOGS, REPO)}/):")
        for name, s in self.stages.items():
            r = self.results[name]
            begin = self.started.get(name)
            at = f"from {begin - self.t0:5.0f} s" if begin else " " * 12
            print(f"  {name:12s} {r.seconds:7.0f} s  {at}  {r.status}")
        failed = [n for n, r in self.results.items() if r.status != "ok"]
        print(f"  {'total':12s} {total:7.0f} s  ({total / 60:.1f} min)"
              + (f"  FAILED: {', '.join(failed)}" if failed else "  all stages passed"))
        for name in failed:
            self._print_failure(name)
        print(BYTE_CODE_NOTE)
        if total > WARN_MINUTES * 60:
            print(f"WARNING: make test took {total / 60:.1f} min, more than {WARN_MINUTES} min: "
                  "the suite's ceiling is 45 min and CI stops at 90; see docs/testing.md "
                  "for where the time goes and how to cut it")
        return 1 if failed else 0


    def _print_failure(self, name: str) -> None:
        """What a failed stage said last, so that the end of the output (all
        CI may keep) names the failing tests: pytest's FAILED/ERROR summary
        lines where there are some, else the log's last lines."""
        path = os.path.join(LOGS, f"{name}.log")
        try:
            with open(path, errors="replace") as f:
                lines = f.read().splitlines()
        except OSError:
            return
        summary = [ln for ln in lines if ln.startswith(("FAILED ", "ERROR "))]
        shown = summary[:FAILURE_LINES] if summary else lines[-FAILURE_LINES:]
        print(f"\n{name} failed; from {os.path.relpath(path, REPO)}:")
        for ln in shown:
            print(f"  {ln[:400]}")


def _needed(names: Sequence[str]) -> List[Stage]:
    """The stages named and every stage they need, in STAGES order."""
    by_name = {s.name: s for s in STAGES}
    want: set = set()
    todo = list(names)
    while todo:
        n = todo.pop()
        if n not in by_name:
            raise SystemExit(f"no stage {n!r}; stages: {', '.join(by_name)}")
        if n not in want:
            want.add(n)
            todo.extend(by_name[n].needs)
    return [s._replace(after=[d for d in s.after if d in want],
                       after_any=[d for d in s.after_any if d in want])
            for s in STAGES if s.name in want]


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="", help="comma-separated stages (with what they need)")
    a = p.parse_args(argv)
    stages = _needed(a.only.split(",")) if a.only else STAGES
    return Runner(stages).run()


if __name__ == "__main__":
    sys.exit(main())
