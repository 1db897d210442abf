"""The node's watchdog: ends a node that has stopped running.

A node heartbeats to the driver from a C thread, and that same thread kills
the node's process group when the driver connection is lost (see
``ember._trainer``).  A node that is *frozen* (SIGSTOP, a debugger's stop, a
cgroup freeze) runs no thread at all: the driver counts it lost after
``heartbeat_timeout``, but the process itself would stay forever, holding
its ports and memory, even after the driver is gone.  Nothing on the driver
can end it (it may live on another host), so every node started by Ember
has this watchdog beside it on its own host.

The watchdog is a small process forked (twice, so it is nobody's child to
reap) from the node before the node does anything else.  It lives in its
own process group, so a signal sent to the node's group does not stop it
too, and every ``poll`` seconds it reads the node's state and scheduler
counters from ``/proc``.  It SIGKILLs the node's whole process group when
the node has been stopped ('T', 't') for ``heartbeat_timeout``, or, while
the node heartbeats (:func:`arm` .. :func:`disarm`, told over a pipe), when
none of its threads has run for ``heartbeat_timeout``: the heartbeat thread
wakes several times per timeout, so that is exactly when the driver counts
the node's heartbeats missing, and a node merely idle (waiting for its
peers to register, say) is never taken for frozen.  The kernel then closes
the node's sockets, so its ports are free.  When the node exits by itself,
the watchdog ends whatever the node left in its process group and exits.

Single-threaded on both sides: ``start``, ``arm`` and ``disarm`` are called
by the node's main thread.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Optional, Tuple


_told: Optional[int] = None  # the node's end of the pipe to its watchdog

logger = logging.getLogger("ember.node")


def start(timeout: float, name: str = "node") -> None:
    """Forks the watchdog of this process (a node launched as the leader of its
    own session) and returns at once in this process.  ``name`` names the node
    in the watchdog's log lines (``node 3``).

    Call it before any thread is started.  Does nothing when ``timeout`` is not
    positive or when this process does not lead its own session (then its
    process group is not its own to kill).
    """
    global _told
    if timeout <= 0 or os.getsid(0) != os.getpid():
        return
    node = os.getpid()
    try:
        r, w = os.pipe()
        first = os.fork()
    except OSError as exc:  # the node still runs; only a freeze would go unseen
        logger.warning(f"{name} (pid {node}): watchdog not started ({exc}): a frozen node "
                       "is not killed; it is still counted lost after heartbeat_timeout")
        return
    if first:
        os.close(r)
        os.set_blocking(w, False)
        _told = w
        os.waitpid(first, 0)  # the middle process exits at once
        return
    try:
        if os.fork() == 0:
            _detach(keep=r)
            _watch(node, timeout, r, name)
    finally:
        os._exit(0)


def arm() -> None:
    """Tells the watchdog the node heartbeats from now on: a node none of whose
    threads runs for the timeout is then frozen.  No-op without a watchdog."""
    _tell(b"1")


def disarm() -> None:
    """Tells the watchdog the node's heartbeats stopped (it is ending): only a
    stop ('T') counts again.  No-op without a watchdog."""
    _tell(b"0")


def _tell(what: bytes) -> None:
    if _told is not None:
        try:
            os.write(_told, what)
        except OSError:
            pass  # the watchdog is gone: nothing to tell


def _detach(keep: int) -> None:
    """Own process group; no file of the node's held open but stderr and ``keep``."""
    os.setpgid(0, 0)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(2, 1)  # not the launcher's status pipe: its EOF must mean the node is gone
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd != keep:
            try:
                os.close(fd)
            except OSError:
                pass
    os.set_blocking(keep, False)


def _watch(node: int, timeout: float, told: int, name: str = "node") -> None:
    # The node leads its session and this process stays in it, so the node's
    # pid (the session id) is not reused while we watch: killpg(node) and
    # /proc/<node> always mean the node's group, even after it exited.
    poll = min(0.5, max(0.05, timeout / 20))
    last_cpu: Optional[int] = None
    last_runs: Optional[int] = None
    armed = False  # the node heartbeats (arm/disarm)
    ran = time.monotonic()  # when the node was last seen running
    while True:
        try:
            news = os.read(told, 64)
        except BlockingIOError:
            news = b""
        except OSError:
            news = b""
        if news:
            armed = news[-1:] == b"1"
            ran = time.monotonic()  # count from the change on
        stat = _stat(node)
        now = time.monotonic()
        if stat is None:  # the node exited: end what it left behind
            _kill_group(node)
            return
        state, cpu = stat
        if state in ("T", "t"):  # stopped (SIGSTOP, a debugger)
            running = False
        elif not armed:  # no heartbeat thread yet: idle is not frozen
            running = True
        elif cpu != last_cpu:  # it used CPU: the cheap answer, most of the time
            running = True
        else:  # idle or frozen: did any of its threads get scheduled at all?
            runs = _runs(node)
            running = runs is None or runs != last_runs  # no counters: only stops count
            last_runs = runs
        last_cpu = cpu
        if running:
            ran = now
        elif now - ran >= timeout:
            logger.warning(f"watchdog: {name} (pid {node}) has not run for {now - ran:.1f} s "
                           f"(state {state}; heartbeat_timeout {timeout:g} s): killing its "
                           "process group")
            _kill_group(node)
            return
        time.sleep(poll)


def _stat(pid: int) -> Optional[Tuple[str, int]]:
    """(state, CPU ticks used by all its threads), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        state, cpu = fields[0], int(fields[11]) + int(fields[12])  # utime + stime
    except (OSError, IndexError, ValueError):
        return None
    return None if state in ("Z", "X") else (state, cpu)


def _runs(pid: int) -> Optional[int]:
    """How many times the kernel has scheduled its threads (``schedstat``), or
    None when the kernel keeps no such counters."""
    runs, seen = 0, False
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                runs += int(f.read().split()[2])
            seen = True
        except (OSError, IndexError, ValueError):
            pass  # that thread just ended, or no counters
    return runs if seen else None


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # nothing left in it
