"""PyTorch on Ember: ``torch.distributed`` from the cluster spec, and gradient
averaging on Ember's collective.

DistributedDataParallel as is (gloo)::

    import ember.torch

    def main_fun(args, ctx):
        ember.torch.init_process_group(ctx)              # gloo, from the cluster spec
        model = torch.nn.parallel.DistributedDataParallel(build_model())
        ...                                              # the usual DDP loop

DDP with its gradient allreduce on Ember's collective (shared memory between
nodes on one host, Ember's ring over TCP otherwise)::

        ddp = torch.nn.parallel.DistributedDataParallel(build_model())
        ddp.register_comm_hook(ctx.collective, ember.torch.allreduce_hook)

Or no ``torch.distributed`` at all, for the CPU path: an optimizer that
averages the gradients before each step, and one broadcast of the initial
parameters::

        model = build_model()
        ember.torch.broadcast_parameters(model, ctx)     # rank 0's weights everywhere
        opt = ember.torch.DistributedOptimizer(torch.optim.Adam(model.parameters()), ctx)
        for x, y in my_batches:                          # the same number of steps per rank
            opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()

Ranks are the chief and workers in ``RANK`` order (``ctx.collective.rank``
is the same number).  Tensors must be on the CPU (the collective works on
host memory in place).
"""

from __future__ import annotations

import datetime
import os
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from ember.collective import collective_of

__all__ = ["init_process_group", "allreduce_hook", "allreduce_gradients",
           "DistributedOptimizer", "broadcast_parameters"]

_WIRE = {torch.float32: np.float32, torch.float64: np.float64,
         torch.int32: np.int32, torch.int64: np.int64}


def _host_array(t: torch.Tensor, what: str) -> np.ndarray:
    """A numpy view of a contiguous CPU tensor's memory (no copy)."""
    if t.device.type != "cpu":
        raise ValueError(f"{what} is on {t.device}: Ember's collective works on CPU tensors")
    if not t.is_contiguous():
        raise ValueError(f"{what} is not contiguous")
    return t.detach().numpy()


# ---------------------------------------------------------------- torch.distributed

def init_process_group(ctx: Any = None, backend: str = "gloo",
                       timeout: Optional[float] = None, **kwargs: Any) -> None:
    """``torch.distributed.init_process_group`` for this node, from the cluster spec.

    Ember sets ``MASTER_ADDR``, ``MASTER_PORT`` (the chief's framework port,
    reserved by Ember), ``RANK`` and ``WORLD_SIZE`` in every chief/worker
    node's environment.  torch's store binds ``MASTER_PORT`` without
    SO_REUSEPORT, so Ember's hold on the framework port is released first
    (``ctx.release_port()``).

    :param ctx: the node's ``ctx`` (None: only the environment is used).
    :param backend: ``"gloo"`` (CPU) or ``"nccl"``.
    :param timeout: seconds for the group's operations (torch's default if None).
    """
    import torch.distributed as dist

    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
               if not os.environ.get(k)]
    if missing:
        who = f"{ctx.job_name}:{ctx.task_index}" if ctx is not None else "this process"
        raise RuntimeError(f"{who} has no {', '.join(missing)} in its environment: only the "
                           "chief and worker nodes of ember.spark.run take part in "
                           "torch.distributed")
    if ctx is not None:
        ctx.release_port()
    if timeout is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout)
    dist.init_process_group(backend=backend, init_method="env://",
                            rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), **kwargs)


def allreduce_hook(state: Any, bucket: Any) -> Any:
    """A DDP communication hook: averages each gradient bucket on Ember's collective.

    ``ddp_model.register_comm_hook(ctx.collective, ember.torch.allreduce_hook)``;
    ``state`` is the node's ``ctx`` or its ``ctx.collective``.  The bucket is
    reduced in place (the call blocks, with the GIL released, until every rank
    has contributed) and returned as a completed future.
    """
    coll = collective_of(state)
    buf = bucket.buffer()
    coll.allreduce(_host_array(buf, "the gradient bucket"), "avg")
    fut: Any = torch.futures.Future()
    fut.set_result(buf)
    return fut


def _annotate_hook() -> None:
    # DDP checks a hook's annotations against the real classes, and this module's
    # annotations are strings (from __future__ import annotations)
    import torch.distributed as dist

    if dist.is_available():
        allreduce_hook.__annotations__ = {"state": object, "bucket": dist.GradBucket,
                                          "return": torch.futures.Future[torch.Tensor]}


_annotate_hook()


# ---------------------------------------------------------------- without torch.distributed

def _params(params: Any) -> List[torch.Tensor]:
    if isinstance(params, torch.nn.Module):
        return list(params.parameters())
    out: List[torch.Tensor] = []
    for p in params:
        if isinstance(p, dict):  # an optimizer's param group
            out.extend(p["params"])
        else:
            out.append(p)
    return out


def allreduce_gradients(params: Any, ctx: Any, op: str = "avg") -> None:
    """Averages (``op``) the ``.grad`` of ``params`` over all ranks, in place.

    ``params``: a module, an iterable of tensors or of param groups.  Every
    parameter that requires a gradient takes part (a missing ``.grad`` counts
    as zeros and is set, so every rank reduces the same layout); the
    gradients are packed into one buffer per dtype, one allreduce each.
    """
    coll = collective_of(ctx)
    groups: Dict[torch.dtype, List[torch.Tensor]] = {}
    for p in _params(params):
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if p.grad.is_sparse:
            raise ValueError("sparse gradients are not supported; use dense embeddings")
        if p.grad.dtype not in _WIRE:
            # the extension's dtype rule, checked here before any group is
            # reduced: a rank that failed half-way would leave its peers with
            # a step of mismatched collectives
            raise TypeError(f"gradient dtype {p.grad.dtype} is not supported "
                            "(float32, float64, int32, int64)")
        groups.setdefault(p.grad.dtype, []).append(p)
    for ps in groups.values():
        grads = [p.grad for p in ps]
        flat = torch.cat([g.reshape(-1) for g in grads]) if len(grads) > 1 \
            else grads[0].reshape(-1).clone()
        coll.allreduce(_host_array(flat, "the gradients"), op)
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset:offset + n].view_as(g))
            offset += n


def broadcast_parameters(params: Any, ctx: Any, root: int = 0) -> None:
    """Copies rank ``root``'s values into ``params`` on every rank.

    ``params``: a module (parameters and buffers, e.g. BatchNorm statistics),
    a state dict, or an iterable of tensors.  One broadcast of everything
    packed as bytes."""
    coll = collective_of(ctx)
    if isinstance(params, torch.nn.Module):
        tensors = list(params.parameters()) + list(params.buffers())
    elif isinstance(params, dict):
        tensors = [t for t in params.values() if isinstance(t, torch.Tensor)]
    else:
        tensors = _params(params)
    tensors = [t for t in tensors if t.numel() > 0]
    if not tensors:
        return
    arrays = [np.ascontiguousarray(_host_array(t.detach().contiguous(), "a parameter"))
              for t in tensors]
    packed = np.empty(sum(a.nbytes for a in arrays), dtype=np.uint8)
    offset = 0
    for a in arrays:
        packed[offset:offset + a.nbytes] = a.reshape(-1).view(np.uint8)
        offset += a.nbytes
    coll.broadcast(packed, root)
    if coll.rank == root:
        return
    offset = 0
    with torch.no_grad():
        for t, a in zip(tensors, arrays):
            value = packed[offset:offset + a.nbytes].view(a.dtype).reshape(tuple(t.shape))
            t.copy_(torch.from_numpy(value.copy()))
            offset += a.nbytes


def DistributedOptimizer(optimizer: torch.optim.Optimizer, ctx: Any) -> torch.optim.Optimizer:
    """Makes ``optimizer.step()`` average the gradients over all ranks first.

    The same optimizer object is returned (its class becomes a subclass whose
    ``step`` calls :func:`allreduce_gradients` on its param groups), so its
    state and any scheduler attached to it stay as they are.  Every rank
    must call ``step()`` the same number of times.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"expected a torch.optim.Optimizer, not {type(optimizer).__name__}")
    coll = collective_of(ctx)
    if getattr(optimizer, "_ember_collective", None) is not None:
        optimizer._ember_collective = coll
        return optimizer
    if "step" in vars(optimizer):
        raise ValueError("wrap the optimizer with DistributedOptimizer before attaching an "
                         "LR scheduler (the scheduler has replaced optimizer.step)")
    base = type(optimizer)

    def step(self: Any, closure: Any = None) -> Any:
        if closure is not None:
            raise ValueError("DistributedOptimizer.step() takes no closure (each closure "
                             "call would need its own allreduce); compute the loss first")
        allreduce_gradients(self.param_groups, self._ember_collective)
        return base.step(self)

    cls = type(base.__name__, (base,), {"step": step, "__module__": base.__module__,
                                        "__doc__": base.__doc__})
    optimizer.__class__ = cls
    optimizer._ember_collective = coll
    return optimizer
