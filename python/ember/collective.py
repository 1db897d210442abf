"""Collectives between the chief and worker nodes of a cluster, on numpy arrays.

Inside ``main_fun(args, ctx)``::

    grads = np.asarray(...)                  # float32/float64/int32/int64
    ctx.allreduce(grads, op="avg")           # in place, same result on every node
    ctx.broadcast(weights, root=0)           # in place, root's values everywhere
    table = ctx.allgather(counts)            # shape (size, *counts.shape)
    ctx.barrier()

The ranks are the fed nodes (chief first, then the workers by task index: the
same order as ``RANK`` in the environment, which ``torch.distributed`` reads).
Each node reserves a port for the collectives when it registers; the
communicator (``ember._ember.Communicator``: ring / recursive doubling, shared
memory between nodes on one host, TCP otherwise, authenticated with the job
secret) is created on the first collective call, which every rank makes, and
closed when ``main_fun`` returns.  The C calls run with the GIL released and
read and write the arrays' memory directly.

A dead peer makes the call fail at once, a silent one after ``timeout``
seconds, with :class:`ember.errors.EmberError` naming the rank; after any
failure the communicator stays broken (every later call raises), as the other
ranks cannot know how far this one got.

Arguments are checked in one place, the extension (``ember._ember.Communicator``):
the reduction op (``"sum"``, ``"avg"`` or its alias ``"mean"``, ``"min"``,
``"max"``: ValueError otherwise, TypeError for a non-str), the element type
(float32, float64, int32, int64 in native byte order: TypeError), a writable
contiguous buffer (TypeError), the root rank and the timeout (ValueError).
This module adds only what the extension cannot know: that the buffer is a
numpy array (whose dtype and shape it adds to the extension's TypeError), and
the communicator's lifetime.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Dict, List, Optional

import numpy as np

from ember import _env, _ember

__all__ = ["Collective", "trainer_addresses", "DEFAULT_TIMEOUT"]

#: Default seconds for the connection of all ranks and for each collective call
#: (``EMBER_COLLECTIVE_TIMEOUT`` overrides it).
DEFAULT_TIMEOUT = 600.0

_FEED_ROLES = ("chief", "worker")


def trainer_addresses(nodes: List[Dict[str, Any]]) -> List[str]:
    """``host:port`` of every fed node's collective port, in rank order.

    Each node registers its collective port last in its ``ports`` (after the
    framework, feed and optional TensorBoard ports); see ``ember._trainer``."""
    trainers = [n for n in nodes if n["role"] in _FEED_ROLES]
    trainers.sort(key=lambda n: (n["role"] != "chief", n["task_index"]))
    return [_address(n["host"], n["ports"][-1]) for n in trainers]


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _check_array(array: Any, what: str) -> np.ndarray:
    """``array`` if it is a numpy array.  Everything else about it (writable,
    contiguous, its dtype) the extension checks when it takes its buffer."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{what} takes a numpy array, not {type(array).__name__} "
                        "(torch: tensor.numpy() of a CPU tensor)")
    return array


def _named(exc: TypeError, array: np.ndarray) -> TypeError:
    """The extension's TypeError about ``array`` (which names its buffer format,
    ``'B'``), with the array's numpy dtype and shape added."""
    return TypeError(f"{exc} (the array: dtype {array.dtype}, shape {array.shape})")


def collective_of(ctx: Any) -> Any:
    """A NodeContext's collective, or a Collective itself (anything with
    allreduce/broadcast/size/rank), for the framework adapters."""
    coll = getattr(ctx, "collective", ctx)
    for name in ("allreduce", "broadcast", "size", "rank"):
        if not hasattr(coll, name):
            raise TypeError(f"expected an ember NodeContext or ember.collective.Collective, "
                            f"not {type(ctx).__name__}")
    return coll


class Collective:
    """The communicator of one rank, created on first use.

    Built by the node process (``ctx.collective``); tests and tools can build
    one from addresses and an already bound socket (``listen_fd``, taken over).
    """

    def __init__(self, rank: int, addresses: List[str], secret: bytes,
                 listen_fd: int = -1, timeout: Optional[float] = None,
                 tcp_only: bool = False, encrypt: bool = False) -> None:
        if not 0 <= rank < len(addresses):
            raise ValueError(f"rank {rank} is not in 0..{len(addresses) - 1}")
        self.rank = rank
        self.size = len(addresses)
        self.addresses = list(addresses)
        self.timeout = (_env.seconds("EMBER_COLLECTIVE_TIMEOUT", DEFAULT_TIMEOUT)
                        if timeout is None else float(timeout))
        self._secret = secret
        self._listen_fd = listen_fd
        self._tcp_only = tcp_only
        self._encrypt = encrypt  # TCP between ranks as AES-256-GCM records
        self._comm: Any = None
        self._closed = False
        self._lock = threading.Lock()

    # -- lifetime -----------------------------------------------------------
    def communicator(self) -> Any:
        """The ``_ember.Communicator``, connecting to every rank on first call
        (a collective step: every rank must reach it within ``timeout``)."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"rank {self.rank}: the collective is closed "
                                   "(main_fun returned)")
            if self._comm is None:
                fd, self._listen_fd = self._listen_fd, -1
                self._comm = _ember.Communicator(self.rank, self.addresses, self._secret,
                                                 self.timeout, listen_fd=fd,
                                                 tcp_only=self._tcp_only,
                                                 encrypt=self._encrypt)
            return self._comm

    @property
    def connected(self) -> bool:
        """True once the communicator has been created."""
        return self._comm is not None

    def close(self) -> None:
        """Leaves the group: a call in flight on another thread fails, peers see
        this rank go.  Idempotent."""
        with self._lock:
            self._closed = True
            comm, self._comm = self._comm, None
            fd, self._listen_fd = self._listen_fd, -1
        if comm is not None:
            comm.close()
        if fd >= 0:
            os.close(fd)

    def __enter__(self) -> "Collective":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- collectives --------------------------------------------------------
    def allreduce(self, array: np.ndarray, op: str = "sum",
                  timeout: Optional[float] = None) -> np.ndarray:
        """Reduces ``array`` elementwise over all ranks, in place; returns it.

        :param array: a contiguous, writable float32/float64/int32/int64
            array (native byte order) of the same shape on every rank.
        :param op: ``"sum"``, ``"avg"`` (alias ``"mean"``; integer avg
            truncates toward zero), ``"min"`` or ``"max"``.  Every rank gets
            bit-identical results.
        :param timeout: seconds; None for the collective's default.
        """
        _check_array(array, "allreduce")
        try:
            self.communicator().allreduce(array, op, timeout)
        except TypeError as exc:
            raise _named(exc, array) from exc
        return array

    def broadcast(self, array: np.ndarray, root: int = 0,
                  timeout: Optional[float] = None) -> np.ndarray:
        """Copies rank ``root``'s ``array`` into ``array`` on every rank, in place.

        Any dtype; the array must be contiguous, writable and of the same size
        in bytes on every rank; ``root`` a rank in ``0..size-1``."""
        _check_array(array, "broadcast")
        try:
            self.communicator().broadcast(array, root, timeout)
        except TypeError as exc:
            raise _named(exc, array) from exc
        return array

    def allgather(self, array: np.ndarray, timeout: Optional[float] = None) -> np.ndarray:
        """Returns a new array of shape ``(size, *array.shape)``: row ``r`` is
        rank ``r``'s ``array`` (same shape and dtype on every rank)."""
        if not isinstance(array, np.ndarray):
            raise TypeError(f"allgather takes a numpy array, not {type(array).__name__}")
        send = np.ascontiguousarray(array)
        out = np.empty((self.size,) + send.shape, dtype=send.dtype)
        self.communicator().allgather(send, out, timeout)
        return out

    def barrier(self, timeout: Optional[float] = None) -> None:
        """Returns once every rank has entered the barrier."""
        self.communicator().barrier(timeout)
