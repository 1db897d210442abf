"""Where a YARN task sits in Ember's rendezvous (shared by the client and
:mod:`ember.yarn.task`; no imports, so that ``python -m ember.yarn.task``
does not find itself imported by its package first)."""

from __future__ import annotations

from typing import Dict

#: the cloudpickled ``experiment_fn``, localized into every container's directory
EXPERIMENT_FILE = "experiment.pkl"
#: node roles in the reservation server's order (see csrc/include/ember/rendezvous.h)
RDV_ORDER = ("ps", "chief", "evaluator", "worker")
#: seconds of silence after which the client counts a task lost, and a task
#: cut off from the client ends itself (ember/rendezvous.h)
HEARTBEAT_TIMEOUT_S = 30.0


def node_index(role: str, task_index: int, topo: Dict[str, int]) -> int:
    """The reservation node index the C server maps to ``role:task_index``.

    The server assigns roles by node index (TensorFlowOnSpark's order): the
    first ``ps`` indexes are ps, then one chief, then one evaluator, then the
    workers; so a YARN task claims its role by registering under that index."""
    if role not in RDV_ORDER:
        raise ValueError(f"task type {role!r} takes no part in the rendezvous")
    if not 0 <= task_index < topo[role]:
        raise ValueError(f"{role}:{task_index} is not in the plan ({topo[role]} {role} node(s))")
    offset = 0
    for r in RDV_ORDER:
        if r == role:
            return offset + task_index
        offset += topo[r]
    raise AssertionError(role)


def role_of(index: int, topo: Dict[str, int]) -> str:
    """The task name (``"worker:1"``) of rendezvous node ``index``."""
    for role in RDV_ORDER:
        if index < topo[role]:
            return f"{role}:{index}"
        index -= topo[role]
    raise ValueError(f"node index {index} is beyond the plan's nodes")
