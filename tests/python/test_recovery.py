"""Node failures on an embedded local[4] Spark: a hung (SIGSTOPped) node is
ended and raised within the heartbeat bound, and a restart feeds only the
epochs the checkpoint has not covered."""

from __future__ import annotations

import collections
import os
import signal
import socket
import threading
import time

import pytest

import nodefuns
from conftest import signal_node_when_ready
from ember.spark import EmberNodeError, InputMode, run


def _state(pid):
    """The process state letter of ``pid`` (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _listening(port):
    """True while some socket listens on local TCP ``port``."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in list(f)[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":
                    return True
    return False


_NODE = """
import os, subprocess, sys, threading, time
from ember import _watchdog
_watchdog.start(1.0)
if sys.argv[1] == "armed":
    # as the node's C heartbeat thread: wakes several times per timeout
    threading.Thread(target=lambda: [time.sleep(0.2) for _ in iter(int, 1)], daemon=True).start()
    _watchdog.arm()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(child.pid, flush=True)
time.sleep(float(sys.argv[2]))
"""


def _node_with_watchdog(mode, lives):
    """A process like a node (own session, watchdog with a 1 s timeout) that
    starts a child in its group and sleeps ``lives`` s; returns (proc, child pid)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _NODE, mode, str(lives)],
                            stdout=subprocess.PIPE, start_new_session=True)
    child = int(proc.stdout.readline())
    return proc, child


def _gone(pid, within):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if _state(pid) in (None, "Z"):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("mode", ["armed", "idle"])
def test_watchdog_kills_a_stopped_node_and_its_group(mode):
    proc, child = _node_with_watchdog(mode, 60)
    try:
        time.sleep(0.5)
        proc.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        proc.wait(10)
        assert proc.returncode == -signal.SIGKILL
        # not at once: counted from when the watchdog last saw it run, which on
        # a loaded machine (its 50 ms polls late) can be a few tenths before the stop
        assert 0.5 < time.monotonic() - stopped < 3
        assert _gone(child, 2)  # its process group went with it
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("mode", ["armed", "idle"])
def test_watchdog_leaves_a_live_node_alone_and_ends_what_it_left(mode):
    """Alive but idle for 3 timeouts (only its heartbeat thread wakes, or, not
    armed, nothing at all): not killed.  When it exits, its child goes too."""
    proc, child = _node_with_watchdog(mode, 3)
    try:
        assert proc.wait(10) == 0
        assert _gone(child, 3)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_hung_node_is_ended_and_raised_within_the_heartbeat_bound(local_spark, tmp_path):
    """SIGSTOP one of two nodes during train(): the driver raises an
    EmberNodeError naming it within heartbeat_timeout + 2 s, and the frozen
    process is killed (with its process group), its ports closed."""
    sc = local_spark.sparkContext
    timeout = 4.0
    # made before the signal: parallelizing takes seconds on a loaded machine,
    # and a failure meanwhile is raised only once train() starts
    rdd = sc.parallelize([(i, [1.0]) for i in range(200000)], 4)
    cluster = run(sc, nodefuns.sleep_in_feed, {"out": str(tmp_path)}, num_executors=2,
                  input_mode=InputMode.SPARK, reservation_timeout=60,
                  heartbeat_timeout=timeout)
    holder: dict = {}
    stopper = threading.Thread(target=signal_node_when_ready,
                               args=(str(tmp_path), holder, signal.SIGSTOP))
    stopper.start()
    try:
        with pytest.raises(EmberNodeError) as err:
            cluster.train(rdd, feed_timeout=60)
        raised = time.monotonic()
    finally:
        stopper.join()
        victim = holder.get("victim")
        if victim is not None and _state(victim["pid"]) == "T":  # never leave it frozen
            os.kill(victim["pid"], signal.SIGKILL)
        cluster.shutdown(timeout=30)
    assert err.value.node == 1 and "node 1" in str(err.value)
    assert "heartbeats stopped" in str(err.value) or "no heartbeat" in str(err.value)
    took = raised - holder["signalled_at"]
    assert took < timeout + 2, f"raised {took:.1f} s after the SIGSTOP"
    # the frozen process was ended, not left behind, and its ports are free
    # (a dying process shows "Z" before its last thread has closed its files)
    deadline = time.monotonic() + 5

    def ended():
        return _state(victim["pid"]) in (None, "Z") and \
            not any(_listening(p) for p in victim["ports"])

    while not ended() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _state(victim["pid"]) in (None, "Z"), "the hung node outlived the failure"
    assert not any(_listening(p) for p in victim["ports"]), "its ports still listen"
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", victim["ports"][1]), timeout=2).close()


def test_restart_feeds_only_the_epochs_the_checkpoint_lacks(local_spark, tmp_path):
    """3 epochs over 2 nodes that checkpoint at each epoch's end; node 1 is
    SIGKILLed in the middle of epoch 1 (the second).  With max_restarts=1 the
    restarted nodes resume from epoch 1 (ctx.resume_from), and train() feeds
    epochs 1 and 2 whole and epoch 0 not again: every record is trained once
    per epoch, except the records of the interrupted epochs trained before the
    kill (trained again after it)."""
    sc = local_spark.sparkContext
    n, epochs = 2000, 3
    rdd = sc.parallelize([(i, [float(i)]) for i in range(n)], 4)
    cluster = run(sc, nodefuns.epoch_checkpoints, {"out": str(tmp_path), "step": 0.05},
                  num_executors=2, input_mode=InputMode.SPARK, reservation_timeout=60,
                  heartbeat_timeout=4, max_restarts=1)
    holder: dict = {}
    killer = threading.Thread(target=nodefuns.kill_mid_epoch, args=(str(tmp_path), holder, 1, 200))
    killer.start()
    try:
        fed = cluster.train(rdd, num_epochs=epochs, feed_timeout=120)
    finally:
        killer.join()
        cluster.shutdown(timeout=60)
    assert "counts" in holder, "node 1 was not killed in epoch 1"
    assert cluster.restarts == 1 and cluster.restart_causes[0].node == 1
    runs = nodefuns.epoch_counts(str(tmp_path))
    assert sorted(runs) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [runs[i, 1]["start"] for i in (0, 1)] == [1, 1]  # both resumed from epoch 1

    def per_epoch(restart):
        return collections.Counter({e: sum(runs[i, restart]["counts"].get(e, 0) for i in (0, 1))
                                    for e in range(epochs)})

    before, after = per_epoch(0), per_epoch(1)
    # the restarted feed: epoch 0 not again, epochs 1 and 2 whole, labelled so
    assert after == {0: 0, 1: n, 2: n}, after
    assert fed == 2 * n
    assert all(runs[i, 1]["labels"][0] == 1 for i in (0, 1))
    # before the kill: epoch 0 whole, epoch 1 in part
    assert before[0] == n and 200 <= before[1] < n, before
    # so the records trained twice are exactly those of the interrupted
    # epochs trained before the kill
    assert sum(before.values()) + sum(after.values()) == epochs * n + before[1] + before[2]


def test_the_lost_node_is_named_not_the_peer_its_loss_broke(monkeypatch):
    """A host dies: its peer's allreduce breaks at once and that peer reports
    first, the dead node's dropped connection a moment later.  The driver
    names the dead node; a failure that is only a vanished peer is reported
    as it is when no cause follows within the grace."""
    import ember.driver as driver

    def cluster():
        c = driver.Cluster.__new__(driver.Cluster)
        c._lock = threading.Lock()
        c._changed = threading.Condition(c._lock)
        c._failures = []
        return c

    def report(c, err, delay):
        def add():
            time.sleep(delay)
            with c._lock:
                c._failures.append(err)
                c._changed.notify_all()
        threading.Thread(target=add, daemon=True).start()

    casualty = ("ember node 0 failed with exit code 1:\nEmberError: allreduce #35: recv from "
                "rank 1 (198.18.0.5:34979) (the peer failed, was killed or left): reset")
    c = cluster()
    report(c, EmberNodeError(casualty, 0), 0)
    report(c, EmberNodeError("ember node 1 was lost", 1, "lost"), 0.5)
    time.sleep(0.1)
    start = time.monotonic()
    got = c._failure()
    assert got.node == 1 and got.kind == "lost" and 0.2 < time.monotonic() - start < 2
    # no cause follows: the casualty is the failure, after the grace
    monkeypatch.setattr(driver, "_CAUSE_GRACE", 0.5)
    c = cluster()
    report(c, EmberNodeError(casualty, 0), 0)
    time.sleep(0.1)
    assert c._failure().node == 0
    # a node that failed by itself is named at once, before its peers' casualties
    c = cluster()
    c._failures += [EmberNodeError(casualty, 1), EmberNodeError("node 0: ValueError", 0)]
    assert c._failure().node == 0
