"""What :func:`ember.yarn.run_on_yarn` takes and gives: task specs and
topologies (tf-yarn's), the per-task results and the failure."""

from __future__ import annotations

import dataclasses
import enum
import re
from typing import Any, Dict, List, Mapping, Optional, Union

from ember.errors import RunFailed  # noqa: F401  (importable from here, as before)
from ember.yarn._topology import RDV_ORDER

#: the task types run_on_yarn accepts (tf-yarn's)
TASK_TYPES = ("chief", "worker", "ps", "evaluator", "tensorboard")


class NodeLabel(enum.Enum):
    """YARN node label of a task's containers (tf-yarn's): CPU is the
    default partition (no label expression), GPU the ``gpu`` label."""

    CPU = ""
    GPU = "gpu"


_UNITS = {"": 1 << 20, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
          "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_memory(memory: Union[int, str]) -> int:
    """MiB from an int (MiB, as tf-yarn) or a string such as ``"2 GiB"``,
    ``"512 MiB"``, ``"2GB"`` (decimal), ``"2g"`` (binary); rounded up."""
    if isinstance(memory, bool):
        raise ValueError(f"memory must be MiB or a string like '2 GiB', not {memory!r}")
    if isinstance(memory, int):
        mib = memory
    elif isinstance(memory, str):
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", memory)
        unit = m.group(2).lower() if m else ""
        if not m or unit not in _UNITS:
            raise ValueError(f"memory {memory!r} is not a size like '2 GiB', '512 MiB', "
                             "'2 GB' or an int of MiB")
        nbytes = float(m.group(1)) * _UNITS[unit]
        mib = -(-int(nbytes) // (1 << 20))
    else:
        raise ValueError(f"memory must be MiB (int) or a string like '2 GiB', "
                         f"not {type(memory).__name__}")
    if mib <= 0:
        raise ValueError(f"memory must be positive, got {memory!r}")
    return mib


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """Resources of one task type (tf-yarn's ``TaskSpec``).

    Attributes:
        memory: per container, MiB (int) or a string such as ``"2 GiB"``.
        vcores: virtual cores per container.
        instances: containers of this type.
        nb_proc_per_worker: processes per ``worker`` container, each its own
            node (local rank ``LOCAL_RANK``), e.g. one per GPU.
        label: :class:`NodeLabel` of the containers.
    """

    memory: Union[int, str]
    vcores: int
    instances: int = 1
    nb_proc_per_worker: int = 1
    label: NodeLabel = NodeLabel.CPU

    @property
    def memory_mb(self) -> int:
        return parse_memory(self.memory)


def single_server_topology(memory: Union[int, str] = "2 GiB", vcores: int = 1,
                           nb_proc_per_worker: int = 1) -> Dict[str, TaskSpec]:
    """One chief (tf-yarn's ``single_server_topology``)."""
    return {"chief": TaskSpec(memory, vcores, nb_proc_per_worker=nb_proc_per_worker)}


def ps_strategy_topology(nb_workers: int = 2, nb_ps: int = 1, memory: Union[int, str] = "2 GiB",
                         vcores: int = 1, nb_proc_per_worker: int = 1,
                         evaluator: bool = False,
                         tensorboard: bool = False) -> Dict[str, TaskSpec]:
    """A chief, ``nb_workers`` workers and ``nb_ps`` parameter servers
    (tf-yarn's ``ps_strategy_topology``), plus an evaluator and a tensorboard
    task when asked."""
    topo = {"chief": TaskSpec(memory, vcores),
            "worker": TaskSpec(memory, vcores, instances=nb_workers,
                               nb_proc_per_worker=nb_proc_per_worker),
            "ps": TaskSpec(memory, vcores, instances=nb_ps)}
    if evaluator:
        topo["evaluator"] = TaskSpec(memory, vcores)
    if tensorboard:
        topo["tensorboard"] = TaskSpec(memory, vcores)
    return topo


def validate(task_specs: Mapping[str, TaskSpec]) -> Dict[str, int]:
    """Checks the specs before anything is staged; returns the rendezvous
    topology (nodes per role, nb_proc)."""
    if not isinstance(task_specs, Mapping) or not task_specs:
        raise ValueError("task_specs must be a non-empty dict of task type -> TaskSpec")
    for kind, spec in task_specs.items():
        if kind not in TASK_TYPES:
            raise ValueError(f"unknown task type {kind!r} in task_specs; run_on_yarn accepts "
                             f"{', '.join(TASK_TYPES)}")
        if not isinstance(spec, TaskSpec):
            raise ValueError(f"task_specs[{kind!r}] must be a TaskSpec, not "
                             f"{type(spec).__name__}")
        if not isinstance(spec.instances, int) or spec.instances < 1:
            raise ValueError(f"task_specs[{kind!r}].instances must be >= 1, got "
                             f"{spec.instances!r} (leave the type out instead)")
        spec.memory_mb  # raises on a bad size
        if not isinstance(spec.vcores, int) or spec.vcores < 1:
            raise ValueError(f"task_specs[{kind!r}].vcores must be >= 1, got {spec.vcores!r}")
        if not isinstance(spec.label, NodeLabel):
            raise ValueError(f"task_specs[{kind!r}].label must be a NodeLabel, "
                             f"not {spec.label!r}")
        if not isinstance(spec.nb_proc_per_worker, int) or spec.nb_proc_per_worker < 1 or \
                (kind != "worker" and spec.nb_proc_per_worker != 1):
            raise ValueError(f"task_specs[{kind!r}].nb_proc_per_worker must be 1"
                             + (" or more" if kind == "worker" else
                                " (several processes per container are for workers)")
                             + f", got {spec.nb_proc_per_worker!r}")
    for kind in ("chief", "evaluator", "tensorboard"):
        if kind in task_specs and task_specs[kind].instances != 1:
            raise ValueError(f"task_specs[{kind!r}].instances must be 1 (TensorFlow has one "
                             f"{kind}), got {task_specs[kind].instances}")
    if "chief" not in task_specs and "worker" not in task_specs:
        raise ValueError("task_specs needs a 'chief' or a 'worker' task: nothing would train")
    nb_proc = task_specs["worker"].nb_proc_per_worker if "worker" in task_specs else 1
    topo = {kind: (task_specs[kind].instances if kind in task_specs else 0)
            for kind in RDV_ORDER}
    topo["worker"] *= nb_proc
    topo["nb_proc"] = nb_proc
    topo["tensorboard"] = 1 if "tensorboard" in task_specs else 0
    return topo


# --------------------------------------------------------------------------- results

@dataclasses.dataclass
class TaskResult:
    """One task's outcome.  ``metrics`` is what the task returned (the dict
    of the experiment or of ``f(ctx)``); ``wall_s`` its time from start to
    report; ``exit_status`` its container's exit status (None when unknown);
    ps and tensorboard containers are stopped by the AM (``stopped``)."""

    task: str
    exit_status: Optional[int] = None
    wall_s: Optional[float] = None
    metrics: Optional[Dict[str, Any]] = None
    container: Optional[str] = None
    host: Optional[str] = None
    stopped: bool = False


@dataclasses.dataclass
class Metrics:
    """What :func:`run_on_yarn` returns: per task results (``metrics["worker:1"]``),
    the application ids of every attempt, and the wall time of the run."""

    tasks: Dict[str, TaskResult]
    app_ids: List[str]
    wall_s: float
    #: where the tensorboard task served (None without one)
    tensorboard_url: Optional[str] = None

    @property
    def attempts(self) -> int:
        return len(self.app_ids)

    @property
    def app_id(self) -> str:
        return self.app_ids[-1]

    def __getitem__(self, task: str) -> TaskResult:
        return self.tasks[task]
