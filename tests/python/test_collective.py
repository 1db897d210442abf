"""Tests of ember._ember.Communicator: ranks are processes on loopback
(multiprocessing, spawn), results are checked against numpy.

Each rank reserves its own port (reserve_port keeps the socket, which the
Communicator takes over), sends the port to the parent and gets back the full
address list: no port can be stolen in between.  Every rank can generate
every other rank's input from the seed, so each checks its own result
against numpy and also reports a digest, which must match across ranks (the
collectives give every rank the same bits).
"""
from __future__ import annotations

import hashlib
import importlib
import multiprocessing as mp
import os
import threading
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import pytest

from ember import _ember as E

SECRET = b"0123456789abcdef0123456789abcdef"
WRONG = b"fedcba9876543210fedcba9876543210"
DTYPES = [np.float32, np.float64, np.int32, np.int64]
OPS = ["sum", "avg", "min", "max"]
SIZES = [0, 1, 7, 4099, 100003]  # 4099 x 8 bytes > the 64 KiB small-message path


# ---------------------------------------------------------------- worlds

def _host(rank: int, own_hosts: bool) -> str:
    """127.0.0.<rank+1> with own_hosts: one machine, but a host of its own
    to the collective's choice of algorithm."""
    return "127.0.0.%d" % (rank + 1) if own_hosts else "127.0.0.1"


def _rank_main(rank: int, n: int, to_parent: Any, from_parent: Any, module: str, fn_name: str,
               own_hosts: bool, kwargs: Dict[str, Any]) -> None:
    try:
        fd, port = E.reserve_port(_host(rank, own_hosts))
        to_parent.put((rank, port))
        addresses = from_parent.get(timeout=60)
        fn = getattr(importlib.import_module(module), fn_name)  # a test module's rank program
        result = fn(rank, n, addresses, fd, **kwargs)
        to_parent.put((rank, "ok", result))
    except BaseException:  # reported to the parent, which fails the test
        to_parent.put((rank, "error", traceback.format_exc()))


def run_world(n: int, fn: Callable[..., Any], timeout: float = 120.0,
              expect_dead: Optional[List[int]] = None, own_hosts: bool = False,
              **kwargs: Any) -> List[Any]:
    """Runs fn(rank, n, addresses, listen_fd, **kwargs) in n spawned processes;
    returns the ranks' results in rank order (None for expect_dead ranks)."""
    ctx = mp.get_context("spawn")
    to_parent = ctx.Queue()
    inboxes = [ctx.Queue() for _ in range(n)]
    procs = [ctx.Process(target=_rank_main,
                         args=(r, n, to_parent, inboxes[r], fn.__module__, fn.__name__,
                               own_hosts, kwargs),
                         daemon=True) for r in range(n)]
    for p in procs:
        p.start()
    try:
        ports = {}
        deadline = time.monotonic() + timeout
        while len(ports) < n:
            rank, port = to_parent.get(timeout=max(1.0, deadline - time.monotonic()))
            ports[rank] = port
        addresses = ["%s:%d" % (_host(r, own_hosts), ports[r]) for r in range(n)]
        for q in inboxes:
            q.put(addresses)
        results: Dict[int, Any] = {}
        errors = []
        dead = set(expect_dead or [])
        while len(results) + len(errors) < n - len(dead):
            rank, status, value = to_parent.get(timeout=max(1.0, deadline - time.monotonic()))
            if status == "ok":
                results[rank] = value
            else:
                errors.append("rank %d:\n%s" % (rank, value))
        assert not errors, "\n".join(errors)
        return [results.get(r) for r in range(n)]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def _inputs(rank: int, dtype: Any, size: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, rank, size, np.dtype(dtype).num])
    if np.issubdtype(dtype, np.floating):
        return rng.standard_normal(size).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min // 2, info.max // 2, size, dtype=dtype, endpoint=True)


def _reference(n: int, dtype: Any, size: int, op: str, seed: int) -> np.ndarray:
    stack = np.stack([_inputs(r, dtype, size, seed) for r in range(n)])
    if op == "min":
        return stack.min(axis=0)
    if op == "max":
        return stack.max(axis=0)
    s = stack.sum(axis=0, dtype=dtype)  # integer sums wrap, as in Ember
    if op == "sum":
        return s
    if np.issubdtype(dtype, np.floating):
        return (s / dtype(n)).astype(dtype)
    return np.where(s >= 0, s // n, -((-s) // n)).astype(dtype)  # C: toward zero


# ---------------------------------------------------------------- rank programs

def rank_every_op(rank: int, n: int, addresses: List[str], fd: int, tcp_only: bool,
                  algorithm: str = "ring") -> Dict[str, Any]:
    comm = E.Communicator(rank, addresses, SECRET, 60.0, listen_fd=fd, tcp_only=tcp_only)
    with comm:
        assert comm.rank == rank and comm.size == n
        assert comm.algorithm(np.zeros(SIZES[-1], np.float32)) == algorithm
        assert comm.algorithm(np.zeros(SIZES[-2], np.int32)) == "recursive doubling"
        kinds = {comm.transport(p) for p in range(n) if p != rank}
        assert kinds == {"tcp" if tcp_only else "shm"}, kinds
        assert comm.transport(rank) == "self"
        digest = hashlib.sha256()
        for dtype in DTYPES:
            for op in OPS:
                for size in SIZES:
                    a = _inputs(rank, dtype, size, seed=1)
                    out = comm.allreduce(a, op)
                    assert out is a  # in place, the same object back
                    want = _reference(n, dtype, size, op, seed=1)
                    if np.issubdtype(dtype, np.floating):
                        tol = 1e-5 if dtype == np.float32 else 1e-12
                        np.testing.assert_allclose(a, want, rtol=tol, atol=tol,
                                                   err_msg="%s %s %d" % (dtype, op, size))
                    else:
                        np.testing.assert_array_equal(a, want,
                                                      err_msg="%s %s %d" % (dtype, op, size))
                    digest.update(a.tobytes())
        # a 2-D and a Fortran-ordered array: any contiguous buffer reduces
        m = np.asfortranarray(np.arange(12, dtype=np.float64).reshape(3, 4) * (rank + 1))
        comm.allreduce(m, "sum")
        np.testing.assert_array_equal(m, np.arange(12).reshape(3, 4) * sum(range(1, n + 1)))
        # broadcast from every root: numpy arrays and a bytearray
        for root in range(n):
            b = np.full(300001, rank, dtype=np.uint8)
            comm.broadcast(b, root=root)
            assert (b == root).all()
            ba = bytearray(b"%d" % rank * 7)
            comm.broadcast(ba, root)
            assert ba == bytearray(b"%d" % root * 7)
        # allgather into (n, *shape)
        for shape in [(0,), (1,), (5, 3), (50001,)]:
            mine = np.full(shape, rank * 10 + 1, dtype=np.int64)
            out = np.empty((n,) + shape, dtype=np.int64)
            assert comm.allgather(mine, out) is out
            for r in range(n):
                assert (out[r] == r * 10 + 1).all()
            out2 = np.zeros((n,) + shape, dtype=np.int64)
            out2[rank] = mine
            comm.allgather(None, out2)
            np.testing.assert_array_equal(out, out2)
        for _ in range(3):
            comm.barrier()
        return {"digest": digest.hexdigest()}


def rank_gil_and_close(rank: int, n: int, addresses: List[str], fd: int) -> Dict[str, Any]:
    comm = E.Communicator(rank, addresses, SECRET, 30.0, listen_fd=fd)
    if rank == 1:
        time.sleep(1.0)  # silent while rank 0 waits, then leaves
        comm.close()
        return {}
    a = np.ones(1000, np.float32)
    box: Dict[str, Any] = {}

    def blocked() -> None:
        try:
            comm.allreduce(a, "sum", timeout=20)
        except BaseException as e:  # the expected abort
            box["exc"] = e

    t = threading.Thread(target=blocked)
    t.start()
    spins, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < 0.3:  # the GIL is free while the call waits
        spins += 1
    comm.close()  # from another thread: aborts the call in flight
    t.join(5)
    assert not t.is_alive()
    assert isinstance(box.get("exc"), E.EmberAborted), box
    assert comm.closed
    with pytest.raises(ValueError, match="closed"):
        comm.barrier()
    return {"spins": spins}


def rank_killed(rank: int, n: int, addresses: List[str], fd: int) -> Dict[str, Any]:
    comm = E.Communicator(rank, addresses, SECRET, 30.0, listen_fd=fd)
    a = np.ones(4 << 20, np.float32)
    if rank == n - 1:
        threading.Timer(0.3, lambda: os._exit(17)).start()
        while True:
            comm.allreduce(a)
    t0 = time.monotonic()
    with pytest.raises(E.EmberError) as ei:
        while True:
            comm.allreduce(a, timeout=30)
    took = time.monotonic() - t0
    assert "rank " in str(ei.value)
    with pytest.raises(E.EmberError, match="broken"):
        comm.barrier()
    comm.close()
    return {"took": took, "error": str(ei.value), "name": ei.value.name}


def rank_wrong_secret(rank: int, n: int, addresses: List[str], fd: int) -> Dict[str, Any]:
    secret = WRONG if rank == 1 else SECRET
    t0 = time.monotonic()
    try:
        E.Communicator(rank, addresses, secret, 2.0, listen_fd=fd)
    except E.EmberError as e:
        return {"type": type(e).__name__, "msg": str(e), "took": time.monotonic() - t0}
    return {"type": None}


# ---------------------------------------------------------------- tests

@pytest.mark.timeout(300)
@pytest.mark.parametrize("n,tcp_only", [(2, False), (3, True), (4, False)])
def test_every_op_matches_numpy(n: int, tcp_only: bool) -> None:
    results = run_world(n, rank_every_op, tcp_only=tcp_only)
    assert len({r["digest"] for r in results}) == 1  # bit-identical on every rank


@pytest.mark.timeout(300)
def test_halving_between_own_hosts_matches_numpy() -> None:
    """4 ranks, each on an address of its own: recursive halving and doubling."""
    results = run_world(4, rank_every_op, own_hosts=True, tcp_only=True, algorithm="halving")
    assert len({r["digest"] for r in results}) == 1


@pytest.mark.timeout(120)
def test_gil_released_and_close_aborts_call_in_flight() -> None:
    r0, _ = run_world(2, rank_gil_and_close)
    assert r0["spins"] > 1000


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [3, 4])
def test_peer_killed_mid_allreduce_fails_fast(n: int) -> None:
    results = run_world(n, rank_killed, expect_dead=[n - 1])
    for r in results[: n - 1]:
        assert r["took"] < 5.0, r
        assert r["name"] in ("EMBER_ECLOSED", "EMBER_EABORTED"), r


@pytest.mark.timeout(120)
def test_wrong_secret_is_rejected() -> None:
    r0, r1 = run_world(2, rank_wrong_secret)
    assert r1["type"] == "EmberAuthError", r1
    assert r0["type"] == "EmberTimeout", r0
    assert "rank(s) 1" in r0["msg"] and "rejected" in r0["msg"], r0


def _port() -> int:
    fd, port = E.reserve_port("127.0.0.1")
    os.close(fd)
    return port


def test_single_rank_and_argument_errors() -> None:
    with E.Communicator(0, ["127.0.0.1:%d" % _port()], SECRET, 5.0) as c:
        a = np.arange(10, dtype=np.float32)
        c.allreduce(a, "avg")
        np.testing.assert_array_equal(a, np.arange(10))
        with pytest.raises(ValueError, match="op must be"):
            c.allreduce(a, "prod")
        with pytest.raises(TypeError, match="float32, float64, int32 and int64"):
            c.allreduce(np.zeros(4, np.float16))
        assert c.algorithm(a) == "none"
        with pytest.raises(TypeError, match="float32, float64, int32 and int64"):
            c.algorithm(np.zeros(4, np.float16))
        with pytest.raises(TypeError, match="writable contiguous"):
            c.allreduce(np.zeros((4, 4), np.float32)[:, 1])
        ro = np.zeros(4, np.float32)
        ro.flags.writeable = False
        with pytest.raises(TypeError, match="writable"):
            c.allreduce(ro)
        with pytest.raises(ValueError, match="root"):
            c.broadcast(a, root=1)
        with pytest.raises(ValueError, match="recv has"):
            c.allgather(a, np.zeros(3, np.float32))
        with pytest.raises(ValueError, match="timeout"):
            c.barrier(timeout=-1)
    assert c.closed
    with pytest.raises(ValueError, match="closed"):
        c.allreduce(a)
    with pytest.raises(ValueError, match="rank 2"):
        E.Communicator(2, ["127.0.0.1:1", "127.0.0.1:2"], SECRET)
    with pytest.raises(TypeError, match="addresses"):
        E.Communicator(0, "127.0.0.1:1", SECRET)
    with pytest.raises(E.EmberError, match="host:port"):
        E.Communicator(0, ["localhost"], SECRET)
    with pytest.raises(E.EmberError, match="secret"):
        E.Communicator(0, ["127.0.0.1:%d" % _port()], b"short")


def test_collective_checks_arguments_as_the_extension_does() -> None:
    """ember.collective.Collective (ctx.allreduce...) leaves the op, dtype,
    buffer, root and timeout rules to the extension: one rule, one message,
    and "mean" is the alias of "avg" on both layers."""
    from ember.collective import Collective

    fd, port = E.reserve_port("127.0.0.1")
    with Collective(0, ["127.0.0.1:%d" % port], SECRET, listen_fd=fd, timeout=5.0) as c:
        a = np.arange(10, dtype=np.float32)
        assert c.allreduce(a, "mean") is a
        np.testing.assert_array_equal(a, np.arange(10))
        with pytest.raises(ValueError, match="op must be 'sum', 'avg', 'min' or 'max'"):
            c.allreduce(a, "prod")
        with pytest.raises(TypeError, match=r"float32, float64, int32 and int64 .*"
                           r"\(the array: dtype float16, shape \(4,\)\)"):
            c.allreduce(np.zeros(4, np.float16))
        with pytest.raises(TypeError, match="float32, float64, int32 and int64"):
            c.allreduce(np.zeros(4, ">f4"))  # not native byte order
        with pytest.raises(TypeError, match="writable contiguous"):
            c.allreduce(np.zeros((4, 4), np.float32)[:, 1])
        ro = np.zeros(4, np.float32)
        ro.flags.writeable = False
        with pytest.raises(TypeError, match="writable"):
            c.broadcast(ro)
        with pytest.raises(ValueError, match="root 1 is not a rank"):
            c.broadcast(a, root=1)
        with pytest.raises(ValueError, match="timeout"):
            c.barrier(timeout=-1)
        with pytest.raises(TypeError, match="numpy array"):
            c.allreduce([1.0, 2.0])
