"""GPUs from Spark's scheduler: the request for the nodes' barrier stage, the
check that the cluster can grant it, and ``CUDA_VISIBLE_DEVICES`` from a
task's assigned addresses.

Spark (3+) schedules GPUs itself: executors learn their GPU addresses from a
discovery script (``spark.executor.resource.gpu.*``, or a standalone Worker's
``spark.worker.resource.gpu.*``), a task asks for some (the default
``spark.task.resource.gpu.amount``, or a stage's task ``ResourceProfile``),
and ``TaskContext.resources()["gpu"].addresses`` are the ones it got; no two
running tasks of an executor get the same address.  A process started for a
task sees exactly those GPUs through ``CUDA_VISIBLE_DEVICES`` (with
``CUDA_DEVICE_ORDER=PCI_BUS_ID``, so CUDA numbers the GPUs as nvidia-smi,
and so Spark's discovery scripts, do).

Nothing here imports pyspark at module level: node processes import it.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Dict, List, Optional, Tuple

from ember import _log

GPU = "gpu"


#: EmberModel's inference workers say here which GPUs they took
logger = logging.getLogger("ember.ml")


# --------------------------------------------------------------------------- tasks

def task_gpus() -> List[str]:
    """The GPU addresses Spark assigned to the running task ([] outside a task
    or when the task has none)."""
    from pyspark import TaskContext

    tc = TaskContext.get()
    if tc is None:
        return []
    info = tc.resources().get(GPU)
    return [str(a) for a in info.addresses] if info is not None else []


def cuda_env(gpus: List[str]) -> Dict[str, str]:
    """The environment that makes a process see exactly ``gpus`` ({} for none)."""
    if not gpus:
        return {}
    return {"CUDA_VISIBLE_DEVICES": ",".join(gpus), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


_bound: Optional[str] = None  # the CUDA_VISIBLE_DEVICES this process was given


def bind_task_gpus() -> None:
    """In a Spark Python worker about to load a model: sets ``CUDA_VISIBLE_DEVICES``
    to the task's GPUs, once per process (CUDA reads it when it initializes).

    Spark reuses a Python worker for later tasks, which may be given other
    GPUs while the model stays where it was loaded: EmberModel refuses these
    paths with GPU tasks unless ``spark.python.worker.reuse=false`` (every
    task a fresh worker; :func:`check_python_worker_gpus`), and should a
    worker still meet another GPU a warning says so.  EmberModel's direct
    path has no such limit: its workers are pooled per GPU set."""
    global _bound
    gpus = task_gpus()
    if not gpus:
        return
    value = ",".join(gpus)
    # a Spark Python worker: nobody configures logging here (ember._log)
    _log.default_handler()
    if _bound is None:
        os.environ.update(cuda_env(gpus))
        _bound = value
        logger.info(f"inference worker pid {os.getpid()}: CUDA_VISIBLE_DEVICES={value} "
                    "(the task's GPUs)")
    elif _bound != value:
        logger.warning(f"inference worker pid {os.getpid()}: this task was given GPU(s) "
                       f"{value}, but the model in this reused Python worker was loaded on "
                       f"{_bound}; set spark.python.worker.reuse=false to load it per task, "
                       "or use ArrowPath 'direct'")


# --------------------------------------------------------------------------- driver

def check_python_worker_gpus(conf: Any, path: str) -> None:
    """Raises ValueError where EmberModel's Arrow paths (Spark's Python workers)
    would put a task's model on another task's GPU: with GPU tasks
    (``spark.task.resource.gpu.amount``) and reused Python workers
    (``spark.python.worker.reuse``, on by default), a worker keeps the GPU it
    loaded the model on for later tasks that were given another."""
    amount = conf.get("spark.task.resource.gpu.amount")
    if amount is None or float(amount) <= 0:
        return
    if conf.get("spark.python.worker.reuse", "true").lower() == "false":
        return
    raise ValueError(
        f"ArrowPath {path!r} with GPU tasks (spark.task.resource.gpu.amount={amount}): Spark "
        "reuses a Python worker for later tasks, which may be given other GPUs, while the "
        "model it loaded stays on its first task's; set spark.python.worker.reuse=false, or "
        "use ArrowPath 'direct' (its workers are pooled per GPU)")


_NO_GPUS = ("the executors have GPUs when spark.executor.resource.gpu.amount and "
            "spark.executor.resource.gpu.discoveryScript are set (on a standalone cluster "
            "the Workers also need spark.worker.resource.gpu.amount and "
            "spark.worker.resource.gpu.discoveryScript)")


def _executors(sc: Any) -> List[Tuple[str, str, int, List[str]]]:
    """(id, host:port, cores, GPU addresses) of the live executors, from the
    driver's status store (filled by the executors' registrations)."""
    seq = sc._jsc.sc().statusStore().executorList(True)
    out = []
    for i in range(seq.size()):
        e = seq.apply(i)
        if e.id() == "driver":
            continue
        gpu = e.resources().get(GPU)
        addresses = [str(a) for a in gpu.get().addresses()] if gpu.isDefined() else []
        out.append((str(e.id()), str(e.hostPort()), int(e.totalCores()), addresses))
    return out


def _slots(executors: List[Tuple[str, str, int, List[str]]], cpus: int, gpus: int) -> int:
    return sum(min(cores // cpus, len(addrs) // gpus) for _, _, cores, addrs in executors)


def check_slots(sc: Any, tasks: int, gpus_per_task: int, cpus_per_task: int) -> None:
    """Raises ValueError unless the executors can run ``tasks`` tasks at once
    with ``gpus_per_task`` GPUs each: the barrier stage would otherwise wait
    for slots that never come (Spark retries its own check every 15 s).

    Executors still registering are waited for until the application's
    registration window (``spark.scheduler.maxRegisteredResourcesWaitingTime``
    from its start) has passed."""
    conf = sc.getConf()
    jconf = sc._jsc.sc().conf()
    window = jconf.getTimeAsSeconds("spark.scheduler.maxRegisteredResourcesWaitingTime", "30s")
    deadline = sc.startTime / 1000.0 + window
    per_executor = conf.get("spark.executor.resource.gpu.amount")
    if per_executor is not None and float(per_executor) < gpus_per_task:
        raise ValueError(
            f"gpus_per_node={gpus_per_task}: each executor has "
            f"spark.executor.resource.gpu.amount={per_executor} GPU(s), fewer than one node "
            f"needs; ask for executors with at least {gpus_per_task}")
    while True:
        executors = _executors(sc)
        have = _slots(executors, cpus_per_task, gpus_per_task)
        if have >= tasks:
            return
        if time.time() >= deadline:
            break
        time.sleep(0.5)
    listing = "; ".join(
        f"executor {i} on {hp.rsplit(':', 1)[0]}: {cores} core(s), GPUs "
        f"[{', '.join(addrs)}] -> {min(cores // cpus_per_task, len(addrs) // gpus_per_task)} "
        "slot(s)" for i, hp, cores, addrs in executors) or "no executor has registered"
    hint = "" if any(addrs for _, _, _, addrs in executors) else f" ({_NO_GPUS})"
    raise ValueError(
        f"gpus_per_node={gpus_per_task}: {tasks} node(s) need {tasks} task slot(s) of "
        f"{cpus_per_task} CPU(s) and {gpus_per_task} GPU(s) each at once, and the cluster has "
        f"{have}: {listing}{hint}. Add executors or GPUs, or ask for fewer nodes or GPUs "
        "per node")


def node_profile(sc: Any, tasks: int, gpus_per_task: int) -> Optional[Any]:
    """The task ResourceProfile for ``tasks`` barrier tasks of ``gpus_per_task``
    GPUs each, after checking that the cluster can run them; None where the
    default profile already gives each task that many GPUs
    (``spark.task.resource.gpu.amount``) and the cluster manager takes no
    stage-level profile.  Raises ValueError, naming what to configure, where
    Spark cannot schedule the GPUs."""
    if not isinstance(gpus_per_task, int) or isinstance(gpus_per_task, bool) \
            or gpus_per_task < 1:
        raise ValueError(f"gpus_per_node must be a whole number >= 1 (nodes never share a "
                         f"GPU), got {gpus_per_task!r}")
    master = sc.master or ""
    conf = sc.getConf()
    cpus = int(conf.get("spark.task.cpus", "1"))
    if master.startswith("local") and not master.startswith("local-cluster"):
        raise ValueError(
            f"gpus_per_node={gpus_per_task}: Spark's local mode ({master}) does not schedule "
            "GPUs; run on a cluster manager that does (standalone, YARN or Kubernetes) where "
            + _NO_GPUS)
    if conf.get("spark.executor.resource.gpu.amount") is None:
        raise ValueError(f"gpus_per_node={gpus_per_task}: no executor GPUs are configured; "
                         + _NO_GPUS)
    if conf.get("spark.dynamicAllocation.enabled", "false").lower() == "true":
        raise ValueError("gpus_per_node: Ember's nodes run in a barrier stage, which Spark "
                         "does not run with dynamic allocation "
                         "(spark.dynamicAllocation.enabled=false)")
    check_slots(sc, tasks, gpus_per_task, cpus)
    stage_level = master.startswith(("spark://", "yarn", "k8s://", "local-cluster"))
    if not stage_level:
        default = conf.get("spark.task.resource.gpu.amount")
        if default is not None and float(default) == gpus_per_task:
            return None
        raise ValueError(
            f"gpus_per_node={gpus_per_task}: the cluster manager of {master!r} takes no "
            "stage-level task ResourceProfile (Spark supports them on standalone, YARN and "
            f"Kubernetes); set spark.task.resource.gpu.amount={gpus_per_task} so that every "
            "task gets that many GPUs")
    return task_profile(gpus_per_task, cpus)


def task_profile(gpus_per_task: int, cpus_per_task: int) -> Any:
    """A stage-level task ResourceProfile of that many GPUs and CPUs per task
    (classic Spark, and Spark Connect, whose client builds it the same way)."""
    from pyspark.resource import ResourceProfileBuilder, TaskResourceRequests

    return ResourceProfileBuilder().require(
        TaskResourceRequests().cpus(cpus_per_task).resource(GPU, gpus_per_task)).build
