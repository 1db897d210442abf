"""Nodes (and inference workers) forked from a process that has already
imported their framework.

A node is ``python -m ember._trainer`` (see :mod:`ember.executor`), and the
first thing most ``main_fun`` do is ``import tensorflow`` (or Keras, or
torch): 3-4 CPU seconds on a 2-core machine, paid again by every node of
every job and of every restart on the host, while the job waits for its
slowest node.  Here, the first node of a kind on a host starts a fork
server, ``python -m ember._forkserver``, which imports those frameworks
once and then forks each node of that kind: the node starts with them
imported, in the memory it shares with the server until it writes to it.

What makes nodes "of a kind": everything an import may read, which is the
whole environment the node would have imported its framework in (the
executor's, PYTHONPATH and the job's ``env=``), the Python executable, the
Linux namespaces (a server in another network namespace would fork nodes
on another host: the simulated hosts of the tests share one file system)
and the frameworks to import.  Two things in that environment differ
between the Spark applications on a host and are left out, so that one
server serves them all (each starting its own cost a host 5-7 CPU s per
application and kind): the variables Spark gives each application's
Python workers, which no import reads (:data:`_PER_APPLICATION`), and the
entries of PYTHONPATH that Python could import nothing from (a node's
PYTHONPATH is its Spark worker's ``sys.path``, which has the
application's ``userFiles`` directory, often empty, and on a standalone
cluster the executor's directory, which holds its stdout and stderr).  A
server imports its frameworks with only the other entries on its path,
whichever application started it, and a forked node's ``sys.path`` is
made from its own PYTHONPATH, as its interpreter would have made it.  A
server serves one kind; its socket's name is a hash of it, in a directory
only this user can enter.

A forked node gets what ``spawn_detached`` would have given it: its own
session, the caller's pipes and stderr as its fds 0-2, the caller's working
directory and environment (exactly), and ``sys.argv``; it then runs
its program (:mod:`ember._trainer`) as ``python -m`` would.  The server reaps it and
tells the caller its exit status, so the caller's handle (:class:`Forked`)
behaves like the ``subprocess.Popen`` it replaces.

When not to: a node given GPUs (CUDA must not be initialised before a fork,
and ``CUDA_VISIBLE_DEVICES`` is per node), an executor in a YARN container
(the server would outlive the container, outside YARN's accounting), a job
that imports none of :data:`ember._imports.HEAVY`, and ``EMBER_FORKSERVER=0``
in the executors' environment.  If the server cannot start (its import
fails, say), the node is spawned as before, and imports, and fails, where
its error reaches the driver.

A server exits once it has had no node alive and no request for
``EMBER_FORKSERVER_IDLE`` seconds (default 120).

EmberModel's direct-path inference workers (:mod:`ember.ml._direct_worker`)
are forked the same way, by servers of their own kind (the program a server
forks is part of its kind): the executor JVM starts
:mod:`ember._direct_launcher`, which asks for the worker to be forked with
its own stdin, stdout and stderr, the JVM's pipes, and stands in for it
until it exits.
"""

from __future__ import annotations

import array
import fcntl
import hashlib
import importlib
import importlib.machinery
import json
import logging
import os
import selectors
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

logger = logging.getLogger("ember.forkserver")

__all__ = ["Forked", "spawn", "wanted"]

#: the namespaces a forked node must share with the process that asked for it
_NAMESPACES = ("net", "uts", "mnt", "pid", "ipc", "user", "cgroup")
#: variables no import reads, which differ between nodes of one kind
_UNKEYED = ("EMBER_RESTART",)
#: what Spark gives each application's Python workers (the workers' secret,
#: the application's directories on this host, its log pages): no import
#: reads them, and the applications on a host share servers
_PER_APPLICATION = ("PYTHON_WORKER_FACTORY_SECRET", "SPARK_LOCAL_DIRS", "SPARK_EXECUTOR_DIRS")
_PER_APPLICATION_PREFIXES = ("SPARK_LOG_URL_",)
#: the programs a server forks: each one's ``main()`` runs in the child
PROGRAMS = ("ember._trainer", "ember.ml._direct_worker")
_MAX_REQUEST = 1 << 20


def wanted(preload: Sequence[str], gpus: Sequence[str]) -> bool:
    """Whether a node importing ``preload`` and given ``gpus`` is forked from a server."""
    return bool(preload) and not gpus and os.environ.get("EMBER_FORKSERVER", "1") != "0" \
        and "CONTAINER_ID" not in os.environ and hasattr(socket, "send_fds")


def _directory() -> str:
    """This user's directory of server sockets (0700, checked: another user
    could otherwise put a socket there and be sent our nodes' pipes)."""
    path = os.path.join(tempfile.gettempdir(), f"ember-forkservers-{os.getuid()}")
    if len(path) > 70:  # a socket's path has at most 107 bytes (sun_path)
        path = f"/tmp/ember-forkservers-{os.getuid()}"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if st.st_uid != os.getuid() or st.st_mode & 0o077 or not os.path.isdir(path) \
            or os.path.islink(path):
        raise PermissionError(f"{path} is not a directory only this user can use")
    return path


def _holds_modules(entry: str) -> bool:
    """Whether Python could import anything from a PYTHONPATH entry (an
    absolute path): a zip or a directory with a subdirectory (a package) or a
    module file in it; not a missing or empty directory, nor one of other
    files only (a standalone executor's directory: its stdout and stderr)."""
    suffixes = tuple(importlib.machinery.all_suffixes())
    try:
        with os.scandir(entry) as listing:
            return any(e.name.endswith(suffixes) or e.is_dir() for e in listing)
    except NotADirectoryError:
        return True  # a zip or an egg
    except OSError:
        return False


def _import_path(env: Dict[str, str]) -> str:
    """The PYTHONPATH a server imports its frameworks with: the entries of
    ``env``'s that Python could import from now, resolved from this
    directory (the forked child's), in order."""
    entries: List[str] = []
    for entry in env.get("PYTHONPATH", "").split(os.pathsep):
        entry = os.path.abspath(entry) if entry else ""
        if entry and entry not in entries and _holds_modules(entry):
            entries.append(entry)
    return os.pathsep.join(entries)


def _keyed_env(env: Dict[str, str]) -> List[Tuple[str, str]]:
    """The part of an import environment that makes a kind (the module's
    docstring says what is left out, and why)."""
    keyed = {k: v for k, v in env.items() if k not in _UNKEYED and k not in _PER_APPLICATION
             and not k.startswith(_PER_APPLICATION_PREFIXES)}
    if "PYTHONPATH" in keyed:
        keyed["PYTHONPATH"] = _import_path(env)
    return sorted(keyed.items())


def _child_path(server_path: Sequence[str], server_pythonpath: Sequence[str],
                pythonpath: str, cwd: str) -> List[str]:
    """The ``sys.path`` that ``python -m`` run from ``cwd`` with
    ``PYTHONPATH=pythonpath`` starts with, made from the server's
    (``server_path``, which its own PYTHONPATH entries,
    ``server_pythonpath``, begin): the child's entries first, then the
    server's others, less any of the server's PYTHONPATH entries that the
    child's lacks."""
    own = [os.path.normpath(os.path.join(cwd, p)) for p in pythonpath.split(os.pathsep) if p]
    not_ours = set(server_pythonpath) - set(own)
    path: List[str] = []
    for entry in [cwd, *own, *(p for p in server_path[1:] if p not in not_ours)]:
        if entry not in path:
            path.append(entry)
    return path


def _kind(program: str, preload: Sequence[str], env: Dict[str, str]) -> str:
    namespaces = {}
    for ns in _NAMESPACES:
        try:
            namespaces[ns] = os.readlink(f"/proc/self/ns/{ns}")
        except OSError:
            pass
    keyed = _keyed_env(env)
    text = json.dumps(dict(python=sys.executable, program=program, preload=sorted(preload),
                           env=keyed, ns=namespaces))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


class Forked:
    """A node forked by a server, as much of ``subprocess.Popen`` as the
    callers use: ``pid``, ``stdin``/``stdout`` (the pipes; None when the
    caller gave its own descriptors), ``returncode``, ``poll`` and ``wait``.
    A thread reads the server's word of the node's exit, as the reaper
    thread of a spawned node waits for it."""

    def __init__(self, pid: int, conn: socket.socket, stdin: Any, stdout: Any) -> None:
        self.pid, self.stdin, self.stdout = pid, stdin, stdout
        self.returncode: Optional[int] = None
        self._conn = conn
        self._exited = threading.Event()
        threading.Thread(target=self._read_exit, name=f"ember-reap-{pid}", daemon=True).start()

    def _read_exit(self) -> None:
        data = b""
        try:
            self._conn.settimeout(None)
            while not data.endswith(b"\n"):
                chunk = self._conn.recv(64)
                if not chunk:
                    break
                data += chunk
        except OSError:
            pass
        finally:
            self._conn.close()
        # "exit <code>" from the server; nothing if the server died first
        # (the node is then nobody's child, and its status is lost: -9)
        words = data.decode(errors="replace").split()
        self.returncode = int(words[1]) if len(words) == 2 and words[0] == "exit" else -9
        self._exited.set()

    def poll(self) -> Optional[int]:
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        self._exited.wait(timeout)
        return self.returncode


def spawn(args: List[str], preload: Sequence[str], spawn_env: Dict[str, str],
          import_env: Dict[str, str], start_timeout: float,
          fds: Optional[Sequence[int]] = None) -> Optional[Forked]:
    """``python <args>`` (``-m <one of PROGRAMS> ...``) forked from the
    server of its kind, started if none serves (``import_env``: the
    environment the frameworks are imported in; ``spawn_env``: the child's
    own); None when no server can fork it (the caller spawns it as before).
    The child's stdin, stdout and stderr: new pipes (the handle's) and this
    process's stderr, or ``fds``."""
    program = args[1] if args[:1] == ["-m"] and len(args) > 1 else ""
    if program not in PROGRAMS:
        raise ValueError(f"a fork server runs one of {', '.join(PROGRAMS)}, not {args[:2]}")
    try:
        sock = os.path.join(_directory(), _kind(program, preload, import_env) + ".sock")
        conn = _connect(sock, program, preload, import_env, start_timeout)
    except (OSError, RuntimeError) as exc:
        logger.warning(f"no fork server for {program} importing {', '.join(preload)} ({exc}): "
                       "the process is started, and imports them, itself")
        return None
    ours: List[int] = []  # the handle's ends of new pipes, and the child's
    theirs: List[int] = []
    if fds is None:
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        fds, ours, theirs = (stdin_r, stdout_w, 2), [stdin_w, stdout_r], [stdin_r, stdout_w]
    try:
        request = json.dumps(dict(argv=args[2:], cwd=os.getcwd(), env=spawn_env)).encode()
        socket.send_fds(conn, [request], list(fds))
        conn.shutdown(socket.SHUT_WR)  # the request's end
        conn.settimeout(start_timeout)
        reply = conn.recv(256).decode(errors="replace").split()
        if len(reply) != 2 or reply[0] != "pid":
            raise OSError(f"it answered {' '.join(reply)!r}")
    except OSError as exc:
        conn.close()
        for fd in ours:
            os.close(fd)
        logger.warning(f"the fork server {sock} failed ({exc}): the process is started itself")
        return None
    finally:
        for fd in theirs:
            os.close(fd)
    if not ours:
        return Forked(int(reply[1]), conn, None, None)
    return Forked(int(reply[1]), conn, os.fdopen(ours[0], "wb"), os.fdopen(ours[1], "rb"))


def _connect(sock: str, program: str, preload: Sequence[str], import_env: Dict[str, str],
             start_timeout: float) -> socket.socket:
    """A connection to the server at ``sock``, started first if none listens
    there (one starter at a time: the lock file beside the socket)."""
    with open(sock[:-5] + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return _dial(sock)
        except (FileNotFoundError, ConnectionRefusedError):
            pass
        _start(sock, program, preload, import_env, start_timeout)
        return _dial(sock)


def _dial(sock: str) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(sock)
    except BaseException:
        conn.close()
        raise
    return conn


def _start(sock: str, program: str, preload: Sequence[str], import_env: Dict[str, str],
           start_timeout: float) -> None:
    """Starts the server (detached, its stdin closed, its stderr /dev/null:
    it must hold no pipe of its starter, whose readers would wait for it;
    its stdout is /dev/null once it said "ready") and waits until
    it listens; RuntimeError naming why it did not."""
    import subprocess

    from ember.executor import read_line, spawn_detached

    idle = os.environ.get("EMBER_FORKSERVER_IDLE", "120")
    # it imports only from what makes its kind, whichever application started it
    env = dict(import_env, PYTHONPATH=_import_path(import_env))
    proc = spawn_detached(["-m", "ember._forkserver", sock, idle, program, *preload], b"",
                          env,
                          stderr=subprocess.DEVNULL, cwd=os.path.dirname(sock))
    line = read_line(proc, start_timeout)
    assert proc.stdout is not None
    proc.stdout.close()
    if line != "ready":
        if not line:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        raise RuntimeError(line or f"it did not start within {start_timeout:.0f} s")


# --------------------------------------------------------------------------- the server

def main() -> None:
    """``python -m ember._forkserver <socket> <idle seconds> <program> <module>...``"""
    from ember import _imports

    path, idle, program, modules = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4:]
    status = os.fdopen(os.dup(1), "w")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    _imports.pause_collector_on_heavy_imports()
    try:
        if program not in PROGRAMS:
            raise ValueError(f"{program} is none of {', '.join(PROGRAMS)}")
        for name in modules:
            importlib.import_module(name)
        importlib.import_module(program)
        _imports.cloudpickle()  # what a node's boot record is unpickled with
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(64)
    except BaseException as exc:
        status.write(f"error: {type(exc).__name__}: {exc}\n")
        status.close()
        os._exit(1)
    import gc

    gc.freeze()  # what the imports made stays shared with every node forked
    status.write("ready\n")
    status.close()
    _Server(listener, path, idle, program).serve()


class _Server:
    def __init__(self, listener: socket.socket, path: str, idle: float, program: str) -> None:
        self.listener, self.path, self.idle, self.program = listener, path, idle, program
        self.pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        self.inode = os.stat(path).st_ino
        self.children: Dict[int, socket.socket] = {}
        self.wake_r, self.wake_w = os.pipe()
        for fd in (self.wake_r, self.wake_w):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ)
        self.selector.register(self.wake_r, selectors.EVENT_READ)

    def serve(self) -> None:
        last = time.monotonic()
        while True:
            for key, _ in self.selector.select(timeout=1.0):
                if key.fileobj is self.listener:
                    self._accept()
                    last = time.monotonic()
                else:
                    try:
                        os.read(self.wake_r, 512)
                    except BlockingIOError:
                        pass
            self._reap()
            if self.children:
                last = time.monotonic()
            elif time.monotonic() - last > self.idle or not self._still_mine():
                break
        try:
            if self._still_mine():
                os.unlink(self.path)
        except OSError:
            pass

    def _still_mine(self) -> bool:
        """The socket's name is still this server's (a new server after a
        crash would have replaced it: this one then only finishes its nodes)."""
        try:
            return os.stat(self.path).st_ino == self.inode
        except OSError:
            return False

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass
                conn.close()

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        fds: List[int] = []
        try:
            conn.settimeout(10.0)
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                    struct.calcsize("3i"))
            _, uid, _ = struct.unpack("3i", creds)
            if uid != os.getuid():
                raise PermissionError(f"uid {uid} is not this server's user")
            data, fds, _, _ = socket.recv_fds(conn, _MAX_REQUEST, 3)
            while data:  # up to the end the caller marks (shutdown of its writing side)
                more = conn.recv(_MAX_REQUEST)
                if not more:
                    break
                data += more
                if len(data) > _MAX_REQUEST:
                    raise ValueError(f"a request of more than {_MAX_REQUEST} bytes")
            request = json.loads(data)
            if len(fds) != 3:
                raise ValueError(f"expected 3 file descriptors, got {len(fds)}")
            argv, cwd, env = request["argv"], request["cwd"], request["env"]
            if not (isinstance(argv, list) and all(isinstance(a, str) for a in argv)
                    and isinstance(cwd, str) and isinstance(env, dict)):
                raise ValueError("a request is {argv: [str], cwd: str, env: {str: str}}")
            pid = os.fork()
        except (OSError, ValueError, KeyError, TypeError) as exc:
            try:
                conn.sendall(f"error {type(exc).__name__}: {exc}\n".encode())
            except OSError:
                pass
            conn.close()
            for fd in fds:
                os.close(fd)
            return
        if pid == 0:
            self._become_child(conn, fds, argv, cwd, env)
        for fd in fds:
            os.close(fd)
        self.children[pid] = conn
        try:
            conn.sendall(f"pid {pid}\n".encode())
        except OSError:
            pass

    def _become_child(self, conn: socket.socket, fds: List[int], argv: List[str], cwd: str,
                      env: Dict[str, str]) -> None:
        """In the forked child: what ``Popen([python, -m, <program>, *argv],
        start_new_session=True, env=env)`` from ``cwd`` would have made."""
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            self.selector.close()
            self.listener.close()
            conn.close()
            for other in self.children.values():
                other.close()
            os.close(self.wake_r)
            os.close(self.wake_w)
            os.setsid()
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
            for fd in fds:
                if fd > 2:
                    os.close(fd)
            os.chdir(cwd)
            os.environ.clear()
            os.environ.update(env)
            # as `python -m` from there, with its own PYTHONPATH
            sys.path[:] = _child_path(sys.path, self.pythonpath, env.get("PYTHONPATH", ""), cwd)
            # a fresh process seeds numpy's global generator from the OS;
            # forked, every node would draw what the server would have
            # (Python's own random reseeds itself at a fork)
            legacy_random = sys.modules.get("numpy.random")
            if legacy_random is not None:
                legacy_random.seed()
            program = sys.modules[self.program]
            sys.modules["__main__"] = program
            sys.argv = [program.__file__ or "-m", *argv]
            code = program.main() or 0  # a node's ends with os._exit
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)


if __name__ == "__main__":
    main()
