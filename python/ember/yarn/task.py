"""The process in each YARN container of :func:`ember.yarn.run_on_yarn`:
``python -m ember.yarn.task`` (started by Ember's ApplicationMaster).

It learns who it is from the environment the AM set
(``EMBER_YARN_TASK=<type>:<index>``, ``EMBER_YARN_RDV=<host>:<port>``,
``EMBER_YARN_SECRET_FILE``, ``EMBER_YARN_TOPOLOGY``, ``EMBER_YARN_ATTEMPT``),
registers with the client's reservation server (Ember's C control plane,
authenticated with the per-application secret that YARN localized into the
container as a private file), claiming the node index that the server maps to
its YARN task type and index, waits for the cluster spec, exports
``TF_CONFIG`` / ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT``,
and runs the experiment with an :class:`ember.node.NodeContext` (``ctx``:
``job_name``, ``task_index``, ``cluster_spec``, ``ctx.allreduce``...), as an
Ember node on Spark does (the same code: :mod:`ember._trainer`).  The node's
DONE report carries the task's metrics (JSON) to the client; a failure
reports the traceback, and the exit status fails the container.

A ``custom_task_module`` (tf-yarn's argument) runs instead of this module in
every container; it calls :func:`run_node` with its own ``f(ctx)`` (or
:func:`main` for the default behaviour), so it still takes part in the
rendezvous.

The ``tensorboard`` task type takes no part in the rendezvous: it serves
TensorBoard on the experiment's ``model_dir`` (or ``EMBER_YARN_TENSORBOARD_DIR``)
until the AM stops it when the chief and workers are done.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import socket
import subprocess
import sys
import time
import traceback
from typing import Any, Callable, Dict, Optional, Tuple

from ember import _imports, _log
from ember.yarn._topology import EXPERIMENT_FILE, HEARTBEAT_TIMEOUT_S, RDV_ORDER, node_index

logger = logging.getLogger("ember.yarn.task")

def topology() -> Dict[str, int]:
    """``EMBER_YARN_TOPOLOGY`` ("ps=1,chief=1,evaluator=0,worker=2,nb_proc=1")
    as a dict: the number of rendezvous nodes of each role."""
    raw = os.environ.get("EMBER_YARN_TOPOLOGY", "")
    try:
        topo = {k: int(v) for k, v in (kv.split("=", 1) for kv in raw.split(",") if kv)}
    except ValueError:
        raise RuntimeError(f"EMBER_YARN_TOPOLOGY is malformed: {raw!r}") from None
    missing = [k for k in (*RDV_ORDER, "nb_proc") if k not in topo]
    if missing:
        raise RuntimeError(f"EMBER_YARN_TOPOLOGY={raw!r} lacks {', '.join(missing)} "
                           "(is this process running in a container of run_on_yarn?)")
    return topo


def _task() -> Tuple[str, int]:
    raw = os.environ.get("EMBER_YARN_TASK", "")
    kind, _, index = raw.partition(":")
    if not kind or not index.isdigit():
        raise RuntimeError(f"EMBER_YARN_TASK is {raw!r}, expected <type>:<index> "
                           "(is this process running in a container of run_on_yarn?)")
    return kind, int(index)


def _secret() -> bytes:
    path = os.environ.get("EMBER_YARN_SECRET_FILE", "")
    if not path:
        raise RuntimeError("EMBER_YARN_SECRET_FILE is not set")
    with open(path, "rb") as f:
        return f.read()


def load_experiment_fn(path: str = EXPERIMENT_FILE) -> Callable[[], Any]:
    """The client's ``experiment_fn``, unpickled from the localized file
    (cloudpickle output: the same cloudpickle must be importable here)."""
    with open(path, "rb") as f:
        return pickle.load(f)


def _jsonable(x: Any) -> Any:
    """numpy scalars and arrays become Python numbers and lists; anything
    else that JSON cannot hold becomes its repr."""
    if hasattr(x, "tolist"):
        return x.tolist()
    if hasattr(x, "item"):
        return x.item()
    return repr(x)


class _Status:
    """_trainer._register's status line goes to the container's stderr here."""

    def write(self, text: str) -> None:
        logger.info(text.strip())

    def close(self) -> None:
        pass


def run_node(fn: Callable[[Any], Optional[Dict[str, Any]]],
             reservation_timeout: Optional[float] = None) -> int:
    """Registers this container's task, runs ``fn(ctx)`` and reports its
    result (a JSON-able dict, or None) to the client; returns the exit status
    (0, or 1 when ``fn`` raised: the traceback went to the client)."""
    from ember import _trainer

    kind, index = _task()
    _imports.pause_collector_on_heavy_imports()  # (a custom entry point's task too)
    local_rank = int(os.environ.get("EMBER_YARN_LOCAL_RANK", "0"))
    # this process's Ember lines: stderr, with a timestamp and the task's name
    _log.default_handler(f"{kind}:{index}" + (f" rank {local_rank}" if local_rank else ""))
    topo = topology()
    nb_proc = topo["nb_proc"]
    # nb_proc_per_worker processes per worker container: worker task i runs
    # worker nodes i*nb_proc .. i*nb_proc+nb_proc-1 (one per process)
    role_index = index * nb_proc + local_rank if kind == "worker" else index
    host, _, port = os.environ.get("EMBER_YARN_RDV", "").rpartition(":")
    if not host or not port.isdigit():
        raise RuntimeError(f"EMBER_YARN_RDV is {os.environ.get('EMBER_YARN_RDV')!r}, "
                           "expected <host>:<port>")
    timeout = reservation_timeout or float(os.environ.get("EMBER_YARN_RDV_TIMEOUT", "600"))
    t0 = time.monotonic()

    def main_fun(_: Any, ctx: Any) -> str:
        try:
            result = fn(ctx)
        except BaseException:
            # the client gets it in the FAILED report; the container log too
            logger.exception(f"{kind}:{index}: the task function raised")
            raise
        if result is not None and not isinstance(result, dict):
            raise TypeError(f"the task function returned a {type(result).__name__}; "
                            "it must return a dict of metrics or None")
        return json.dumps({"metrics": result, "wall_s": time.monotonic() - t0,
                           "container": os.environ.get("CONTAINER_ID", ""),
                           "host": socket.gethostname()}, default=_jsonable)

    boot = dict(index=node_index(kind, role_index, topo), driver_host=host,
                driver_port=int(port), secret=_secret(), reservation_timeout=timeout,
                executor_id=os.environ.get("CONTAINER_ID", f"{kind}:{index}"),
                heartbeat_interval_ms=int(os.environ.get("EMBER_YARN_HEARTBEAT_MS", "2000")),
                heartbeat_timeout=HEARTBEAT_TIMEOUT_S,
                input_mode=0, working_dir=os.getcwd(), main_fun=main_fun, args=None,
                report_result=True, tensorboard=False,
                # ps tasks serve Ember's parameter server (ember.ps) until the
                # workers are done or the AM stops them
                parameter_servers=_parameter_servers() if topo["ps"] else None)
    node = _trainer._register(boot, _Status())
    return _trainer._run(boot, *node)


def _parameter_servers() -> Any:
    """How ps tasks serve: asynchronous, or bounded staleness when
    EMBER_YARN_PS_STALENESS (run_on_yarn's env=) says how many steps."""
    from ember.ps import ParameterServers

    raw = os.environ.get("EMBER_YARN_PS_STALENESS", "")
    if raw and not raw.isdigit():
        raise RuntimeError(f"EMBER_YARN_PS_STALENESS is {raw!r}; give a number of steps")
    return ParameterServers(staleness=int(raw) if raw else None)


def _experiment_task(ctx: Any) -> Optional[Dict[str, Any]]:
    """The default task: the experiment of ``experiment_fn`` (an experiment
    kind of :mod:`ember.yarn.experiment`, or a plain ``f(ctx) -> dict``)."""
    experiment_fn = load_experiment_fn()
    experiment = experiment_fn()
    kinds: Tuple[type, ...] = ()
    try:
        from ember.yarn import experiment as kinds_module
        kinds = tuple(getattr(kinds_module, n) for n in ("KerasExperiment", "PytorchExperiment")
                      if hasattr(kinds_module, n))
    except ImportError:
        kinds_module = None  # type: ignore[assignment]
    if callable(experiment) and not isinstance(experiment, kinds):
        return experiment(ctx)
    if kinds_module is None:
        raise RuntimeError(f"experiment_fn returned a {type(experiment).__name__}, which needs "
                           "ember.yarn.experiment (not importable here)")
    # experiment_fn was called once already: hand over what it built
    return kinds_module.run_task(_Built(experiment_fn, experiment), ctx)


def _same(fn: Callable[[], Any]) -> Callable[[], Any]:
    return fn


class _Built:
    """``experiment_fn`` whose first call returns the experiment already built
    (the model is not built twice); it pickles as ``experiment_fn`` itself, so
    processes that run_task spawns (n_workers_per_executor) build their own."""

    def __init__(self, fn: Callable[[], Any], built: Any) -> None:
        self._fn, self._built = fn, built

    def __call__(self) -> Any:
        built, self._built = self._built, None
        return built if built is not None else self._fn()

    def __reduce__(self) -> Any:
        return _same, (self._fn,)


def _tensorboard() -> int:
    """The tensorboard task: TensorBoard on the experiment's model_dir until
    the AM stops it.  Its URL goes to ``tensorboard.url`` in the attempt's
    staging directory, where the client picks it up (``Metrics.tensorboard_url``)."""
    from ember import hdfs

    log_dir = os.environ.get("EMBER_YARN_TENSORBOARD_DIR", "")
    if not log_dir:
        experiment = load_experiment_fn()()
        try:
            from ember.yarn.experiment import tensorboard_dir
            log_dir = tensorboard_dir(experiment) or ""
        except ImportError:
            log_dir = getattr(experiment, "model_dir", None) or ""
    if not log_dir:
        raise RuntimeError("tensorboard task: set EMBER_YARN_TENSORBOARD_DIR (env=) or give "
                           "the experiment a model_dir / tensorboard_hdfs_dir")
    log_dir = hdfs.qualify(log_dir)
    # TensorBoard cannot read hdfs:// without libhdfs: it serves a local copy,
    # refreshed every 30 s
    mirror = hdfs.is_hdfs(log_dir)
    local = os.path.join(os.getcwd(), "tensorboard-logs") if mirror else \
        log_dir[len("file://"):] if log_dir.startswith("file://") else log_dir
    os.makedirs(local, exist_ok=True)
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", local,
                             "--port", str(port), "--bind_all"])
    host = os.environ.get("NM_HOST") or socket.gethostname()
    url = f"http://{host}:{port}"
    published = False
    try:
        next_copy = 0.0
        while proc.poll() is None:
            if not published:
                try:
                    socket.create_connection((host, port), timeout=1).close()
                except OSError:
                    time.sleep(0.5)
                    continue
                logger.info(f"TensorBoard at {url} ({log_dir})")
                staging = os.environ.get("EMBER_YARN_STAGING", "")
                if staging:  # whole or not at all: readers poll for the name
                    hdfs.write_bytes(f"{staging}/tensorboard.url.tmp", url.encode())
                    hdfs.rename(f"{staging}/tensorboard.url.tmp",
                                f"{staging}/tensorboard.url", overwrite=True)
                published = True
            if mirror and time.monotonic() >= next_copy:
                next_copy = time.monotonic() + 30
                try:
                    if hdfs.exists(log_dir):
                        hdfs.download(log_dir, local)
                except Exception as e:  # a half-written checkpoint dir: try again later
                    logger.info(f"copying {log_dir}: {e} (tried again in 30 s)")
            time.sleep(1)
    finally:
        if proc.poll() is None:
            proc.terminate()
    return proc.returncode or 0


def _spawn_local_procs(nb_proc: int) -> int:
    """nb_proc_per_worker > 1: one process per local rank (each its own node),
    tf-yarn's way of using several GPUs of one container; exits with the
    first non-zero status."""
    procs = [subprocess.Popen([sys.executable, "-m", "ember.yarn.task"],
                              env=dict(os.environ, EMBER_YARN_LOCAL_RANK=str(k),
                                       LOCAL_RANK=str(k)))
             for k in range(nb_proc)]
    codes = [p.wait() for p in procs]
    return next((c for c in codes if c != 0), 0)


def main() -> int:
    """The default container entry point (see the module docstring)."""
    kind, index = _task()
    _log.default_handler(f"{kind}:{index}")
    if kind == "tensorboard":
        return _tensorboard()
    nb_proc = topology()["nb_proc"]
    if kind == "worker" and nb_proc > 1 and "EMBER_YARN_LOCAL_RANK" not in os.environ:
        return _spawn_local_procs(nb_proc)
    return run_node(_experiment_task)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # os._exit: the node's control thread (C) must not keep the process alive
    os._exit(code)
