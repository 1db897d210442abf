"""ember._forkserver: nodes forked, their framework imported, from a server
per host and kind; what a forked node starts with is what a spawned one
would; the server refuses what it should and keeps serving; and which
frameworks a main_fun imports (ember._imports.frameworks_of)."""

from __future__ import annotations

import json
import os
import socket
import stat
import sys
import time

import pytest

import nodefuns
from conftest import forked_direct_worker, read_json_files
from ember import _forkserver
from ember._imports import frameworks_of
from ember.errors import EmberNodeError
from ember.spark import InputMode, run


# --------------------------------------------------------------------------- frameworks_of

def _nested(args, ctx):
    def inner():
        import torch  # noqa: F401
    return inner


def _helper():
    import tensorflow as tf
    return tf


def _via_helper(args, ctx):
    return _helper()


def _via_ember(args, ctx):
    import ember.keras  # noqa: F401  (imports keras at its top level)


def _plain(args, ctx):
    import json as j
    return j.dumps(args)


def test_frameworks_of_finds_imports_in_the_body_helpers_closures_and_modules():
    assert frameworks_of(_nested) == ("torch",)
    assert frameworks_of(_via_helper) == ("tensorflow",)
    assert frameworks_of(_via_helper, depth=0) == ()
    assert frameworks_of(_via_ember) == ("keras",)
    assert frameworks_of(_plain) == ()
    assert frameworks_of(nodefuns.report_fork) == ("tensorflow",)
    assert frameworks_of(nodefuns.report_ctx) == ()

    def wrapper(args, ctx):  # as ember.compat.tfos wraps a map_fun
        return _via_helper(args, ctx)
    assert frameworks_of(wrapper) == ("tensorflow",)


def test_frameworks_of_reads_the_functions_args_holds():
    """A main_fun that calls a function it is given (run_task(args["experiment_fn"],
    ctx)) imports what that function imports; other values are not code."""
    import functools

    given = {"experiment_fn": functools.partial(_nested, 1), "out": "/tmp/x", "n": 3}
    assert frameworks_of(_plain, args=given) == ("torch",)
    assert frameworks_of(_plain, args=[_via_helper, "x"]) == ("tensorflow",)
    assert frameworks_of(_plain, args=("torch", 1, None)) == ()
    assert frameworks_of(_plain, args=None) == ()


def test_frameworks_of_reads_the_users_modules_without_importing_them(tmp_path, monkeypatch):
    """``from pkg import sub``: sub is a module of the user's whose function
    imports torch; finding that imports neither (a package's __init__ may
    do anything: this one would write a file)."""
    pkg = tmp_path / "embtest_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(f"open({str(tmp_path / 'imported')!r}, 'w').close()\n")
    (pkg / "sub.py").write_text("def build():\n    import torch\n    return torch\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    namespace: dict = {}
    exec("def main_fun(args, ctx):\n    from embtest_pkg import sub as s\n    s.build()\n",
         namespace)
    assert frameworks_of(namespace["main_fun"]) == ("torch",)
    assert not (tmp_path / "imported").exists() and "embtest_pkg" not in sys.modules


# --------------------------------------------------------------------------- the server

def _processes_with(arg):
    found = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if arg.encode() in f.read().split(b"\0"):
                    found.append(int(d))
        except (OSError, ValueError):
            pass
    return found


@pytest.fixture
def own_dir(monkeypatch):
    """A socket directory of this test's own (TMPDIR; short: a socket's path
    has at most 107 bytes), so no other test's server answers."""
    import pathlib
    import shutil
    import tempfile

    path = pathlib.Path(tempfile.mkdtemp(prefix="embfs", dir="/tmp"))
    monkeypatch.setenv("TMPDIR", str(path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    yield path
    # a server whose socket's name is gone exits within a second
    shutil.rmtree(path, ignore_errors=True)


def test_a_server_that_cannot_import_falls_back_naming_why(own_dir, caplog):
    env = dict(os.environ)
    with caplog.at_level("WARNING", logger="ember.forkserver"):
        assert _forkserver.spawn(["-m", "ember._trainer", "0", "0"], ["no_such_framework"],
                                 env, env, 60) is None
    assert "ModuleNotFoundError" in caplog.text and "no_such_framework" in caplog.text
    assert "started, and imports them, itself" in caplog.text


def test_a_socket_directory_others_can_write_is_refused(own_dir, caplog):
    d = own_dir / f"ember-forkservers-{os.getuid()}"
    d.mkdir(mode=0o777)
    os.chmod(d, 0o777)
    env = dict(os.environ)
    with caplog.at_level("WARNING", logger="ember.forkserver"):
        assert _forkserver.spawn(["-m", "ember._trainer", "0", "0"], ["json"], env, env, 60) \
            is None
    assert "only this user can use" in caplog.text
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o777 and not list(d.iterdir())


def test_garbage_is_refused_and_the_server_keeps_forking(own_dir):
    """A request without its descriptors, one that is not JSON, and one of
    the wrong shape each get an error line; then a real request forks a
    node whose boot record is garbage: it fails with exit status 1, its
    traceback on the stderr it was given, and the server says so."""
    env = dict(os.environ)
    sock = os.path.join(_forkserver._directory(),
                        _forkserver._kind("ember._trainer", ["json"], env) + ".sock")
    _forkserver._connect(sock, "ember._trainer", ["json"], env, 60).close()
    assert len(_processes_with(sock)) == 1

    def ask(payload, fds):
        c = _forkserver._dial(sock)
        socket.send_fds(c, [payload], fds) if fds else c.sendall(payload)
        c.shutdown(socket.SHUT_WR)
        c.settimeout(20)
        return c, c.recv(256).decode()

    for payload, fds in ((b'{"argv": [], "cwd": "/", "env": {}}', []),
                         (b"\x00\xff not json", [0, 1, 2]),
                         (b'{"argv": "x", "cwd": 1, "env": []}', [0, 1, 2])):
        c, reply = ask(payload, fds)
        c.close()
        assert reply.startswith("error "), (payload, reply)
    err = own_dir / "stderr"
    r, w = os.pipe()
    out_r, out_w = os.pipe()
    with open(err, "wb") as e:
        request = json.dumps(dict(argv=["0", "7"], cwd=str(own_dir), env=env)).encode()
        c, reply = ask(request, [r, out_w, e.fileno()])
    os.close(r)
    os.close(out_w)
    os.write(w, b"not a pickle")
    os.close(w)
    assert reply.startswith("pid "), reply
    c.settimeout(60)
    assert c.recv(64).decode().split() == ["exit", "1"]
    c.close()
    os.close(out_r)
    assert "UnpicklingError" in err.read_text()


def test_the_applications_on_a_host_share_a_kind(tmp_path):
    """The variables Spark sets per application (and per executor) and
    PYTHONPATH entries Python could import nothing from do not make a kind;
    an entry it could import from, and any other variable, do."""
    import functools

    app_a, app_b, executor, lib = (tmp_path / d for d in ("a", "b", "executor", "lib"))
    for d in (app_a, app_b, executor, lib):
        d.mkdir()
    (executor / "stdout").write_text("")
    (lib / "helpers.py").write_text("")

    def env(app, n):
        return dict(os.environ, PYTHONPATH=os.pathsep.join([str(lib), str(app), str(executor)]),
                    PYTHON_WORKER_FACTORY_SECRET=n, SPARK_LOCAL_DIRS=f"/x/{n}",
                    SPARK_EXECUTOR_DIRS=f"/x/{n}", SPARK_LOG_URL_STDERR=f"http://h/{n}")

    kind = functools.partial(_forkserver._kind, "ember._trainer", ["tensorflow"])
    assert kind(env(app_a, "1")) == kind(env(app_b, "2")) == \
        kind(dict(env(app_a, "1"), PYTHONPATH=f"{lib}{os.pathsep}/no/such/dir"))
    assert _forkserver._import_path(env(app_b, "2")) == str(lib)
    assert kind(env(app_a, "1")) != kind(dict(env(app_a, "1"), PYTHONPATH=str(app_a)))
    assert kind(env(app_a, "1")) != kind(dict(env(app_a, "1"), EMBER_TEST_KIND_PROBE="1"))
    (app_b / "pkg").mkdir()  # a package: b's entry makes a kind of its own now
    assert kind(env(app_a, "1")) != kind(env(app_b, "2"))


def test_a_forked_childs_path_is_made_from_its_own_pythonpath():
    server = ["/sockets", "/lib", "/usr/lib/python311.zip", "/venv/site-packages"]
    assert _forkserver._child_path(server, ["/lib"], f"/app/b{os.pathsep}/lib{os.pathsep}.",
                                   "/work/b") == \
        ["/work/b", "/app/b", "/lib", "/usr/lib/python311.zip", "/venv/site-packages"]
    # an entry of the server's that the child's PYTHONPATH lacks is not the child's
    assert _forkserver._child_path(server, ["/lib"], "rel", "/work/c") == \
        ["/work/c", "/work/c/rel", "/usr/lib/python311.zip", "/venv/site-packages"]


# --------------------------------------------------------------------------- direct-path workers

def _launch_direct_worker(own_dir, name):
    """``python -m ember._direct_launcher <name> savedmodel`` as the executor
    JVM starts it: pipes for stdin and stdout, a log for stderr."""
    import subprocess

    log = open(own_dir / f"{name}.log", "wb")
    launcher = subprocess.Popen([sys.executable, "-m", "ember._direct_launcher", name,
                                 "savedmodel"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=log, env=dict(os.environ, TMPDIR=str(own_dir)))
    log.close()
    return launcher


def _forked_worker(launcher, own_dir, name):
    """pid of the worker the launcher had forked (waiting up to 120 s)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        worker = forked_direct_worker(launcher.pid)
        if worker is not None:
            return worker
        assert launcher.poll() is None, (launcher.returncode,
                                         (own_dir / f"{name}.log").read_text())
        time.sleep(0.1)
    raise AssertionError(f"no forked worker for {name}")


def test_direct_path_workers_are_forked_and_the_launcher_stands_in(own_dir):
    """The JVM's launcher has the worker forked (TensorFlow imported) with
    the JVM's pipes: the worker answers on them; its exit status is the
    launcher's; a SIGTERM to the launcher reaches the worker."""
    import struct

    first = _launch_direct_worker(own_dir, "bad-magic")
    worker = _forked_worker(first, own_dir, "bad-magic")
    with open(f"/proc/{worker}/cmdline", "rb") as f:
        assert b"ember._forkserver" in f.read()  # forked, not spawned
    first.stdin.write(struct.pack(">i", 1234))
    first.stdin.close()
    status, size = struct.unpack(">ii", first.stdout.read(8))
    assert status == 1 and b"bad magic" in first.stdout.read(size)
    assert first.wait(60) == 1
    assert "ValueError: not an Ember direct-inference stream" in \
        (own_dir / "bad-magic.log").read_text()

    second = _launch_direct_worker(own_dir, "terminated")
    worker = _forked_worker(second, own_dir, "terminated")
    second.send_signal(15)
    assert second.wait(60) == 128 + 15
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{worker}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{worker}")  # reaped by its server
    for p in (first, second):
        p.stdout.close()


# --------------------------------------------------------------------------- forked nodes

def test_nodes_are_forked_with_tensorflow_imported_as_spawned_ones_would_start(
        local_spark, tmp_path):
    """Two jobs whose main_fun imports TensorFlow: every node is forked by
    one server (the second job's too), TensorFlow already imported, in a
    session of its own, with the job's env=, the executor's directory, a
    numpy generator of its own; a node that raises is reported as from a
    spawned node."""
    sc = local_spark.sparkContext
    outs = []
    for job in ("a", "b"):
        out = tmp_path / job
        out.mkdir()
        cluster = run(sc, nodefuns.report_fork, {"out": str(out)}, num_executors=2,
                      input_mode=InputMode.TENSORFLOW, env={"EMBER_TEST_JOB": job},
                      reservation_timeout=120)
        cluster.shutdown(timeout=120)
        outs.append(read_json_files(str(out)))
    a, b = outs
    nodes = a + b
    assert len(nodes) == 4
    assert all(n["preloaded"] and "-m ember._forkserver" in n["parent"] for n in nodes), nodes
    # the job's env= is part of what the server imported in: one server per env=
    assert len({n["ppid"] for n in a}) == 1 and len({n["ppid"] for n in b}) == 1
    assert [n["job_env"] for n in nodes] == ["a", "a", "b", "b"]
    assert all(n["session_leader"] and n["main"] == "ember._trainer" and n["total"] == 3.0
               for n in nodes)
    assert {n["cwd"] for n in nodes} == {os.getcwd()}  # local mode: the driver's directory
    assert len({n["draw"] for n in nodes}) == 4, nodes
    out = tmp_path / "bad"
    out.mkdir()
    start = time.monotonic()
    cluster = run(sc, nodefuns.report_fork, {"out": str(out), "bad": 1}, num_executors=2,
                  input_mode=InputMode.TENSORFLOW, env={"EMBER_TEST_JOB": "a"},
                  reservation_timeout=120)
    with pytest.raises(EmberNodeError, match="boom from forked node 1"):
        cluster.shutdown(timeout=120)
    assert time.monotonic() - start < 60
    again = read_json_files(str(out))
    assert [n["ppid"] for n in again] == [a[0]["ppid"]]  # job a's server, still serving
