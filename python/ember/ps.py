"""Asynchronous training on parameter servers, in Ember's engine (``ember/ps.h``).

The ``ps`` nodes of a cluster started with ``run(..., num_ps=k,
parameter_servers=ParameterServers())`` serve Ember's parameter server
instead of running ``main_fun``: each holds one shard of every table, applies
the optimizer to the gradients workers push, and ends when every worker
finished or at ``cluster.shutdown()``.  The chief and workers reach the
servers through :meth:`ember.node.NodeContext.parameter_servers`::

    def main_fun(args, ctx):
        ps = ctx.parameter_servers()                 # an ember.ps.Client
        ps.declare("emb", "sparse", 10**6, 64, "adagrad", 0.05, init="normal",
                   init_scale=0.01)
        for ids, ... in batches:
            rows = ps.pull("emb", ids, 64)           # only the rows this batch uses
            ...
            ps.push("emb", ids, grads)               # the servers apply Adagrad
            ps.clock()                               # one step (bounded staleness)
        ps.finish()

Keras 3 models train on them with one call (:func:`ember.keras.parameter_servers`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ember import _ember

logger = logging.getLogger("ember.ps")

#: the roles that train (and so are the parameter servers' workers)
WORKER_ROLES = ("chief", "worker")


@dataclasses.dataclass(frozen=True)
class ParameterServers:
    """How the ``ps`` nodes serve (``run(..., parameter_servers=...)``).

    :param staleness: None for fully asynchronous training; ``s`` to hold a
        worker that is more than ``s`` steps (``Client.clock`` calls) ahead
        of the slowest unfinished worker (bounded staleness).
    :param checkpoint_dir: an ``hdfs://`` directory, or one on the ps
        nodes' hosts (shared, or the same host again:
        ``driver_ps_nodes=True``).  Each shard writes
        ``ps-<k>-of-<n>.ckpt`` there every ``checkpoint_secs`` and when it
        ends, and restores it when it starts (a job restarted by
        ``max_restarts`` goes on from there; a chief's initial weights go
        only to rows no push reached: ``PsClient.initialize``).
    :param checkpoint_secs: seconds between a shard's checkpoints.
    """

    staleness: Optional[int] = None
    checkpoint_dir: Optional[str] = None
    checkpoint_secs: float = 60.0

    def __post_init__(self) -> None:
        if self.staleness is not None and not 0 <= self.staleness < 2**32 - 1:
            raise ValueError(f"staleness must be None or 0..2**32-2, got {self.staleness}")
        if not self.checkpoint_secs > 0:
            raise ValueError(f"checkpoint_secs must be positive, got {self.checkpoint_secs}")


class Client:
    """A worker's connection to every parameter-server shard of its job.

    A thin wrapper of :class:`ember._ember.PsClient` (the calls are
    ``declare``, ``pull``, ``push``, ``assign``, ``clock``, ``finish``,
    ``save``, ``bytes``): what it adds is the job's layout, so a node says
    ``ctx.parameter_servers()`` and nothing else.  Not thread-safe.

    A shard on this worker's host is reached through shared memory instead
    of TCP (two rings the client offers once connected; see
    ``docs/parameter-servers.md``), unless the job encrypts its connections
    or ``EMBER_PS_SHM=0``: ``transports`` lists each shard's, such as
    ``["shm", "tcp"]``.  Either way the calls, their results and ``bytes()``
    are the same.
    """

    def __init__(self, client: Any) -> None:
        self._client = client
        self.worker: int = client.worker
        self.num_workers: int = client.num_workers
        self.num_shards: int = client.num_shards

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    @property
    def transports(self) -> List[str]:
        """How each shard is reached, by shard: ``"shm"`` or ``"tcp"``."""
        return list(self._client.transports)

    def close(self) -> None:
        self._client.close()

    def finish_and_close(self, finished: bool) -> None:
        """The end of this worker's main_fun: tells the servers it finished
        (when it did) and closes; a failure here is logged, not raised."""
        try:
            if finished:
                self._client.finish()
        except _ember.EmberError as e:
            logger.warning(f"worker {self.worker}: telling the parameter servers it "
                           f"finished failed: {e}")
        finally:
            self._client.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def shard_addresses(nodes: Sequence[Dict[str, Any]]) -> List[Tuple[str, int]]:
    """(host, port) of each ps node, by task index: the port is the node's
    framework port, which a ps node of Ember's parameter server serves on."""
    ps = sorted((n for n in nodes if n["role"] == "ps"), key=lambda n: n["task_index"])
    return [(n["host"], int(n["ports"][0])) for n in ps]


def worker_rank(nodes: Sequence[Dict[str, Any]], me: Dict[str, Any]) -> Tuple[int, int]:
    """(this node's worker number, the number of workers): the chief first,
    then the workers by task index (the collective's ranks)."""
    trainers = sorted((n for n in nodes if n["role"] in WORKER_ROLES),
                      key=lambda n: (n["role"] != "chief", n["task_index"]))
    indexes = [n["index"] for n in trainers]
    if me["index"] not in indexes:
        raise ValueError(f"a {me['role']} node is not a parameter-server worker: only the "
                         f"chief and the workers push and pull")
    return indexes.index(me["index"]), len(indexes)


def connect(nodes: Sequence[Dict[str, Any]], me: Dict[str, Any], secret: bytes,
            encrypt: bool = False, timeout: float = 600.0) -> Client:
    """A :class:`Client` for node ``me`` of the job whose nodes are ``nodes``."""
    shards = shard_addresses(nodes)
    if not shards:
        raise ValueError("this cluster has no ps nodes: start it with run(..., num_ps=k, "
                         "parameter_servers=ember.ps.ParameterServers())")
    worker, workers = worker_rank(nodes, me)
    client = _ember.PsClient([h for h, _ in shards], [p for _, p in shards], secret, worker,
                             workers, timeout_s=timeout, encrypt=encrypt)
    logger.info(f"worker {worker} of {workers}: parameter-server shards reached over "
                f"{', '.join(client.transports)}")
    return Client(client)


def checkpoint_name(shard: int, num_shards: int) -> str:
    """The file a shard's checkpoint is in (``ember_ps_server_save``)."""
    return f"ps-{shard}-of-{num_shards}.ckpt"


def save_checkpoint(server: Any, shard: int, num_shards: int, directory: str) -> None:
    """``server.save`` into a local directory or an ``hdfs://`` one (written
    locally, uploaded under a temporary name and renamed, so a reader never
    sees half a file)."""
    from ember import hdfs

    if not hdfs.is_hdfs(directory):
        server.save(directory)
        return
    name = checkpoint_name(shard, num_shards)
    with tempfile.TemporaryDirectory(prefix="ember-ps-") as local:
        server.save(local)
        hdfs.makedirs(directory)
        partial = hdfs.join(directory, f".{name}.uploading")
        hdfs.upload(os.path.join(local, name), partial)
        hdfs.rename(partial, hdfs.join(directory, name), overwrite=True)


def restore_checkpoint(server: Any, shard: int, num_shards: int, directory: str) -> bool:
    """Restores ``server`` from its shard's checkpoint in ``directory``
    (local or ``hdfs://``); False when there is none yet."""
    from ember import hdfs

    name = checkpoint_name(shard, num_shards)
    if not hdfs.is_hdfs(directory):
        if not os.path.exists(os.path.join(directory, name)):
            return False
        server.restore(directory)
        return True
    url = hdfs.join(directory, name)
    if not hdfs.exists(url):
        return False
    with tempfile.TemporaryDirectory(prefix="ember-ps-") as local:
        hdfs.download(url, os.path.join(local, name))
        server.restore(local)
    return True


def serve(nodes: Sequence[Dict[str, Any]], me: Dict[str, Any], secret: bytes, listen_fd: int,
          config: ParameterServers, encrypt: bool, stop_requested: Any) -> str:
    """Runs this ps node's shard on ``listen_fd`` (its framework port) until
    every worker finished and disconnected, or ``stop_requested()``;
    returns what ended it."""
    shard = me["task_index"]
    num_shards = len(shard_addresses(nodes))
    workers = sum(1 for n in nodes if n["role"] in WORKER_ROLES)
    staleness = config.staleness
    server = _ember.PsServer(secret, shard, num_shards, workers, staleness=staleness,
                             listen_fd=listen_fd, encrypt=encrypt)
    try:
        where = f"ps shard {shard} of {num_shards}"
        ckpt = config.checkpoint_dir
        if ckpt and restore_checkpoint(server, shard, num_shards, ckpt):
            logger.info(f"{where}: restored {server.stats()['rows_held']} rows from {ckpt}")
        logger.info(f"{where}: serving {workers} workers on port {server.port} "
                    f"({'asynchronous' if staleness is None else f'staleness {staleness}'})")
        next_save = time.monotonic() + config.checkpoint_secs
        while True:
            if stop_requested():
                why = "stopped by the driver"
                break
            stats = server.stats()
            # every worker finished (min_clock is then the finished mark) and
            # left: a worker's main_fun returning finishes and closes its client,
            # while a finish between two fits keeps it connected
            if stats["min_clock"] == 2**64 - 1 and stats["workers_connected"] == 0:
                why = (f"every worker finished: {stats['pushes']} pushes, "
                       f"{stats['pulls']} pulls, {stats['rows_held']} rows held")
                break
            if ckpt and time.monotonic() >= next_save:
                save_checkpoint(server, shard, num_shards, ckpt)
                next_save = time.monotonic() + config.checkpoint_secs
            time.sleep(0.2)
        if ckpt:
            save_checkpoint(server, shard, num_shards, ckpt)
        return why
    finally:
        server.close()


def tensorflow_server(ctx: Any) -> None:
    """TensorFlow's own ParameterServerStrategy on an Ember cluster: call it
    as the whole ``main_fun`` of the ps and worker nodes (the chief runs the
    ``ClusterCoordinator``).  Starts ``tf.distribute.Server`` from the
    ``TF_CONFIG`` Ember set, on the node's framework port, and returns when
    the driver stops the node: ``cluster.shutdown()`` waits for the chief,
    then stops the servers (as TensorFlow's own servers end with their job).

    Run without ``parameter_servers=``: the ps nodes run ``main_fun`` here.
    In InputMode.SPARK, run with ``feed_chief=False`` (the chief reads no
    data): each worker's ``dataset_fn`` reads that worker's feed with
    ``ember.tf.feed_dataset(None, batch_size, element_spec=...)``, which this
    call attaches.
    """
    import tensorflow as tf

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    if resolver.task_type not in ("ps", "worker"):
        raise ValueError(f"tensorflow_server() runs on the ps and worker nodes; this is the "
                         f"{resolver.task_type} (it runs the ClusterCoordinator)")
    server = tf.distribute.Server(resolver.cluster_spec(), job_name=resolver.task_type,
                                  task_index=resolver.task_id,
                                  protocol=resolver.rpc_layer or "grpc", start=True)
    logger.info(f"{resolver.task_type}:{resolver.task_id}: tf.distribute.Server at "
                f"{server.target}")
    if ctx.feed_server is not None:  # InputMode.SPARK: dataset_fns read this node's feed
        from ember import tf as ember_tf

        ember_tf.attach(ctx)
    ctx.serve_until_stopped()
