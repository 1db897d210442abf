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

Or asynchronously on the cluster's parameter servers (``run(..., num_ps=k,
parameter_servers=ember.ps.ParameterServers())``): the optimizer runs on the
servers, and an embedding table may live there row-sparse::

        emb = ember.torch.PsEmbedding(10**9, 16, ctx, name="items")  # on the servers
        model = torch.nn.Sequential(emb, torch.nn.Flatten(), torch.nn.Linear(16, 1))
        opt = ember.torch.ParameterServerOptimizer(model, ctx, "adam", 1e-3)
        for x, y in my_batches:                          # no step count to agree on
            opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()

The node's feed (``cluster.train``) as batches of tensors that share the
feed's memory::

        for x, y in ember.torch.FeedDataset(ctx, batch_size=64):  # to the call's end
            ...
"""

from __future__ import annotations

import datetime
import logging
import os
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import numpy as np
import torch

from ember.collective import collective_of

__all__ = ["init_process_group", "allreduce_hook", "allreduce_gradients",
           "DistributedOptimizer", "broadcast_parameters", "ParameterServerOptimizer",
           "PsEmbedding", "FeedDataset"]

logger = logging.getLogger("ember.torch")

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


# ---------------------------------------------------------------- parameter servers

#: the update rules the parameter servers apply (ember/ps.h)
_PS_KINDS = ("sgd", "momentum", "adagrad", "adam")


def _ps_spec(kind: str, learning_rate: float, momentum: float, beta1: float, beta2: float,
             epsilon: float, initial_accumulator: float) -> Dict[str, Any]:
    """What ``declare`` takes for an optimizer named by a string."""
    kind = kind.lower()
    if kind not in _PS_KINDS:
        raise ValueError(f"the parameter servers apply {', '.join(map(repr, _PS_KINDS))}, "
                         f"not {kind!r}")
    if kind == "sgd" and momentum:
        kind = "momentum"
    spec: Dict[str, Any] = dict(optimizer=kind, learning_rate=float(learning_rate))
    if kind == "momentum":
        spec["momentum"] = float(momentum)
    elif kind == "adagrad":
        spec.update(initial_accumulator=float(initial_accumulator), epsilon=float(epsilon))
    elif kind == "adam":
        spec.update(beta1=float(beta1), beta2=float(beta2), epsilon=float(epsilon))
    return spec


def _ps_optimizer(optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """The parameter servers' version of a torch optimizer: what ``declare``
    takes, or ValueError naming what the servers cannot apply."""
    name = type(optimizer).__name__
    if isinstance(optimizer, torch.optim.SGD):
        kind = "sgd"
    elif isinstance(optimizer, torch.optim.Adagrad):
        kind = "adagrad"
    elif isinstance(optimizer, torch.optim.Adam):
        kind = "adam"
    else:
        raise ValueError(f"the parameter servers apply torch.optim.SGD (with momentum), Adagrad "
                         f"and Adam, not {name}")
    if len(optimizer.param_groups) != 1:
        raise ValueError(f"{name} has {len(optimizer.param_groups)} param groups: the parameter "
                         "servers apply one set of hyper-parameters to every table")
    group = optimizer.param_groups[0]
    keys = ["weight_decay", "nesterov", "amsgrad", "maximize", "lr_decay",
            "decoupled_weight_decay"]
    if group.get("momentum"):  # torch ignores dampening without momentum
        keys.append("dampening")
    unsupported = [f"{k}={group[k]!r}" for k in keys if group.get(k)]
    if unsupported:
        raise ValueError(f"{name}({', '.join(unsupported)}): not applied by the parameter "
                         "servers; leave it unset")
    lr = float(group["lr"])  # a tensor lr (torch 2) reads as its value
    if kind == "sgd":
        return _ps_spec("sgd", lr, float(group.get("momentum", 0.0)), 0.0, 0.0, 0.0, 0.0)
    if kind == "adagrad":
        return _ps_spec("adagrad", lr, 0.0, 0.0, 0.0, float(group["eps"]),
                        float(group["initial_accumulator_value"]))
    beta1, beta2 = group["betas"]
    return _ps_spec("adam", lr, 0.0, float(beta1), float(beta2), float(group["eps"]), 0.0)


def _table_shape(shape: Any) -> Tuple[int, int]:
    """A parameter's shape as the servers' rows x cols (the first axis the rows)."""
    dims = [int(d) for d in shape]
    if not dims:
        return 1, 1
    return dims[0], int(np.prod(dims[1:])) if len(dims) > 1 else 1


def _claim(client: Any, table: str, owner: Any, hint: str) -> None:
    """Records that ``owner`` trains ``table`` through ``client``; refuses a
    second live owner.  Declaring an existing table with the same spec is a
    no-op on the servers, so two models or embeddings given one name would
    otherwise share one table without a word."""
    claims = getattr(client, "_ember_torch_tables", None)
    if claims is None:
        claims = {}
        try:
            client._ember_torch_tables = claims
        except AttributeError:  # a bare PsClient takes no attributes: no check
            return
    held = claims.get(table)
    holder = held() if held is not None else None
    if holder is not None and holder is not owner:
        raise ValueError(f"table {table!r} is already trained by another {hint} in this "
                         f"process: give each its own name")
    claims[table] = weakref.ref(owner)


def _host_rows(t: torch.Tensor, rows: int, cols: int) -> np.ndarray:
    """``t`` as a (rows, cols) float32 numpy array (a view when it already is
    a contiguous float32 CPU tensor, else a copy)."""
    if t.is_sparse:
        t = t.to_dense()
    return t.detach().to("cpu", torch.float32).contiguous().numpy().reshape(rows, cols)


def _client_of(ctx_or_client: Any) -> Any:
    if hasattr(ctx_or_client, "parameter_servers"):
        return ctx_or_client.parameter_servers()
    if all(hasattr(ctx_or_client, m) for m in ("declare", "pull", "push")):
        return ctx_or_client
    raise TypeError(f"expected a node's ctx or an ember.ps.Client, not "
                    f"{type(ctx_or_client).__name__}")


class ParameterServerOptimizer:
    """Trains a model asynchronously on the cluster's parameter servers
    (``run(..., num_ps=k, parameter_servers=ember.ps.ParameterServers())``).

    Used like a ``torch.optim.Optimizer`` (``zero_grad()``, ``step()``).  At
    creation every parameter of ``model`` becomes a dense table
    ``f"{prefix}/{name}"`` on the servers (rows: the first axis), split over
    them by rows; the chief (worker 0) puts its initial values there, every
    node waits for it (``ctx.collective.barrier()``) and copies them into its
    model.  Each ``step()`` then pushes every parameter's ``.grad`` (zeros
    for a parameter without one), counts a step (bounded staleness, if
    configured) and pulls every table into the parameters, without waiting
    for the other workers; :meth:`finish` at the end leaves every worker
    with the servers' final weights.  The servers apply the update rule and keep its
    state per row: this object holds no state, and has no ``state_dict`` or
    ``load_state_dict`` (the servers' state is checkpointed with
    ``ctx.parameter_servers().save(dir)``).  LR schedulers do not apply: the
    learning rate is fixed when the tables are declared.

    :class:`PsEmbedding` modules of the model are left out: their tables are
    row-sparse and pushed from their backward pass.  Buffers (BatchNorm's
    running statistics) stay local to each node.

    The update rules are Keras's (``ember/ps.h``).  SGD, with or without
    momentum, is torch's exactly (torch's momentum buffer is Keras's velocity
    divided by ``-learning_rate``).  Adagrad and Adam put ``epsilon`` where
    Keras does: Adagrad divides by ``sqrt(accumulator + epsilon)`` (torch:
    ``sqrt(accumulator) + eps``); Adam by ``sqrt(v) + epsilon`` with the
    bias correction folded into the step size, so it behaves as torch's Adam
    with ``eps = epsilon / sqrt(1 - beta2**t)`` at step ``t`` (an epsilon
    31 times larger at the first step with beta2 = 0.999, the same after a
    few thousand); with ``epsilon`` far below the gradients' scale the two
    agree to float rounding.  An epsilon of 0 means Keras's 1e-7.

    :param model: the ``torch.nn.Module`` to train; its parameters may be on
        any device and of any float dtype (they travel as float32).
    :param ctx: the node's ``ctx`` (the chief or a worker), or None with
        ``client`` given (no barrier: one worker).
    :param optimizer: ``"sgd"``, ``"momentum"``, ``"adagrad"`` or ``"adam"``,
        or a ``torch.optim.SGD``, ``Adagrad`` or ``Adam`` whose (single) param
        group gives the kind and hyper-parameters (then the keyword
        arguments below are ignored); weight decay, Nesterov, AMSGrad,
        ``maximize``, ``dampening``, ``lr_decay`` and several param groups
        raise ValueError.
    :param learning_rate: the step size.
    :param momentum: SGD's momentum (``"sgd"`` with a momentum is ``"momentum"``).
    :param beta1: Adam's first-moment decay.
    :param beta2: Adam's second-moment decay.
    :param epsilon: Adagrad's and Adam's epsilon (torch's default for Adam).
    :param initial_accumulator: Adagrad's initial accumulator (torch's 0).
    :param prefix: the tables' name prefix: two models trained in one job
        need different prefixes.
    :param client: an :class:`ember.ps.Client` (default ``ctx.parameter_servers()``).
    """

    def __init__(self, model: torch.nn.Module, ctx: Any,
                 optimizer: Union[str, torch.optim.Optimizer] = "adam",
                 learning_rate: float = 1e-3, *, momentum: float = 0.0, beta1: float = 0.9,
                 beta2: float = 0.999, epsilon: float = 1e-8, initial_accumulator: float = 0.0,
                 prefix: str = "model", client: Any = None) -> None:
        if isinstance(optimizer, str):
            spec = _ps_spec(optimizer, learning_rate, momentum, beta1, beta2, epsilon,
                            initial_accumulator)
        elif isinstance(optimizer, torch.optim.Optimizer):
            spec = _ps_optimizer(optimizer)
        else:
            raise TypeError(f"optimizer: expected a name or a torch.optim.Optimizer, not "
                            f"{type(optimizer).__name__}")
        self.client = client if client is not None else _client_of(ctx)
        self.spec = spec
        self.steps = 0
        skip = {id(p) for m in model.modules() if isinstance(m, PsEmbedding)
                for p in m.parameters()}
        # (table, parameter, rows, cols), in named_parameters order (shared
        # parameters once)
        self._tables: List[Tuple[str, torch.Tensor, int, int]] = []
        for name, p in model.named_parameters():
            if id(p) in skip or p.numel() == 0:
                continue
            rows, cols = _table_shape(p.shape)
            table = f"{prefix}/{name}"
            _claim(self.client, table, p, "parameter (ParameterServerOptimizer prefix=)")
            self.client.declare(table, "dense", rows, cols, **spec)
            self._tables.append((table, p, rows, cols))
        if self.client.worker == 0:  # the chief's initial weights are the model's
            for table, p, rows, cols in self._tables:
                # rows a restored checkpoint trained keep their values
                self.client.initialize(table, None, _host_rows(p, rows, cols))
        # None: a client= of one worker, nobody to wait for
        self._collective = getattr(ctx, "collective", ctx) if ctx is not None else None
        if self._collective is not None:
            self._collective.barrier()
        self._pull()
        if self._collective is not None:
            # nobody pushes before everyone pulled: every worker starts the same
            self._collective.barrier()
        floats = sum(rows * cols for _, _, rows, cols in self._tables)
        logger.info(f"worker {self.client.worker}: {len(self._tables)} tables ({floats} floats) "
                    f"of {prefix!r} on {self.client.num_shards} parameter-server shards, "
                    f"{spec['optimizer']} lr {spec['learning_rate']}")

    @property
    def tables(self) -> List[str]:
        """The names of the model's dense tables."""
        return [t for t, _, _, _ in self._tables]

    def _pull(self) -> None:
        with torch.no_grad():
            for table, p, _, cols in self._tables:
                if p.device.type == "cpu" and p.dtype == torch.float32 and p.is_contiguous():
                    # straight into the parameter's memory (checked every step:
                    # model.to() may have moved it)
                    self.client.pull(table, None, cols, out=p.detach().numpy())
                else:
                    value = self.client.pull(table, None, cols)
                    p.copy_(torch.from_numpy(value).reshape(p.shape))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the parameters' gradients (torch.optim.Optimizer.zero_grad)."""
        for _, p, _, _ in self._tables:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_()
                p.grad.zero_()

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Pushes the gradients, counts a step and pulls the new weights;
        returns ``closure()`` (computed first, with gradients on) if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for table, p, rows, cols in self._tables:
            grad = (_host_rows(p.grad, rows, cols) if p.grad is not None
                    else np.zeros((rows, cols), dtype=np.float32))
            self.client.push(table, None, grad)
        self.client.clock()
        self._pull()
        self.steps += 1
        return loss

    def finish(self) -> None:
        """The end of this worker's training: tells the servers it finished
        (so bounded staleness holds nobody back for it), waits for the other
        workers (``ctx.collective.barrier()``) and pulls the final weights, so
        that every worker ends with the model the servers hold (what the
        asynchronous job trained), not with the weights of its own last
        step.  A worker that steps again afterwards counts again."""
        self.client.finish()
        if self._collective is not None:
            self._collective.barrier()
        self._pull()

    def __repr__(self) -> str:
        return (f"ParameterServerOptimizer({len(self._tables)} tables, "
                f"{self.spec['optimizer']}, lr={self.spec['learning_rate']})")


class _PsLookup(torch.autograd.Function):
    """The gather of a batch's pulled rows, whose backward pushes each
    distinct row's summed gradient to the servers (and returns none: the
    pulled rows are a throw-away copy)."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, inverse: torch.Tensor, unique: torch.Tensor,
                push: Callable[[torch.Tensor, torch.Tensor], None]) -> torch.Tensor:
        ctx.save_for_backward(inverse, unique)
        ctx.push = push
        return rows.index_select(0, inverse)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        inverse, unique = ctx.saved_tensors
        summed = torch.zeros((unique.shape[0], grad.shape[1]), dtype=torch.float32)
        summed.index_add_(0, inverse, grad.to("cpu", torch.float32))
        ctx.push(unique, summed)
        return None, None, None, None


class PsEmbedding(torch.nn.Module):
    """An embedding table that lives on the parameter servers, row-sparse.

    ``forward(ids)`` pulls the rows of the batch's distinct ids and gathers
    them (output: ``ids.shape + (embedding_dim,)``, float32, on ``ids``'s
    device); the backward pass pushes one summed gradient per distinct id
    (a repeated id's gradients added up), and the servers apply
    ``optimizer`` to those rows.  Nothing is held locally but the current
    batch's rows, so ``num_embeddings`` may be far beyond a worker's memory
    (10**9 costs the rows a job touches), and the module has no parameters
    or state dict.  Rows start normal with standard deviation
    ``init_scale``, the same on every node and shard for a given ``seed``.
    Under ``torch.no_grad()`` nothing is pushed.

    Put it in a model trained by :class:`ParameterServerOptimizer` (which
    leaves it out of its dense tables) or any other optimizer: its updates
    happen at ``backward()``.

    :param num_embeddings: the rows (ids are ``0..num_embeddings-1``).
    :param embedding_dim: the floats of a row.
    :param ctx_or_client: the node's ``ctx``, or an :class:`ember.ps.Client`.
    :param optimizer: ``"adagrad"`` (the usual choice for embeddings),
        ``"sgd"``, ``"momentum"`` or ``"adam"``, applied by the servers.
    :param learning_rate: its step size.
    :param init_scale: the initial rows' standard deviation.
    :param seed: the initial rows' seed.
    :param name: the table is ``f"{name}/embeddings"``: two embeddings of one
        job need different names.
    :param optimizer_options: ``momentum``, ``beta1``, ``beta2``, ``epsilon``,
        ``initial_accumulator`` for the servers (``PsClient.declare``; 0: Keras's
        defaults, except Adagrad's accumulator, which stays 0).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, ctx_or_client: Any,
                 optimizer: str = "adagrad", learning_rate: float = 0.05,
                 init_scale: float = 0.05, seed: int = 0, name: str = "embedding",
                 **optimizer_options: float) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = int(num_embeddings), int(embedding_dim)
        self.name = name
        self.table = f"{name}/embeddings"
        self.optimizer, self.learning_rate = optimizer, float(learning_rate)
        client = _client_of(ctx_or_client)
        _claim(client, self.table, self, "PsEmbedding (name=)")
        client.declare(self.table, "sparse", self.num_embeddings, self.embedding_dim,
                       optimizer, self.learning_rate, init="normal",
                       init_scale=float(init_scale), seed=int(seed), **optimizer_options)
        self._client = client  # a plain attribute: not a parameter, not saved

    def _push(self, unique: torch.Tensor, grads: torch.Tensor) -> None:
        if unique.numel():
            self._client.push(self.table, unique.numpy(), grads.numpy())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
            raise TypeError(f"{self.name}: ids must be integers, not {ids.dtype}")
        flat = ids.detach().reshape(-1).to("cpu", torch.int64)
        unique, inverse = torch.unique(flat, sorted=True, return_inverse=True)
        if unique.numel() and (int(unique[0]) < 0 or int(unique[-1]) >= self.num_embeddings):
            bad = int(unique[0]) if int(unique[0]) < 0 else int(unique[-1])
            raise IndexError(f"{self.name}: id {bad} is not in 0..{self.num_embeddings - 1}")
        rows = torch.from_numpy(self._client.pull(self.table, unique.numpy(), self.embedding_dim))
        if torch.is_grad_enabled():
            out = _PsLookup.apply(rows.requires_grad_(), inverse, unique, self._push)
        else:
            out = rows.index_select(0, inverse)
        return out.reshape(*ids.shape, self.embedding_dim).to(ids.device)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, table={self.table!r}, "
                f"optimizer={self.optimizer!r}, learning_rate={self.learning_rate}")


class FeedDataset(torch.utils.data.IterableDataset):
    """The node's feed as an ``IterableDataset`` of batches.

    Each element is one batch of ``batch_size`` records (fewer only where the
    data ends), as a tuple of its fields (a single field: the tensor, or with
    ``as_dict`` a ``{field: tensor}``).  A numeric field is a CPU tensor that
    shares the feed's memory: the rows Spark sent are not copied unless a
    batch spans two of the feed's chunks.  Treat those tensors as read-only
    (the feed's memory is); ``.clone()`` one to change it.  A str or bytes
    field is a list.  A pass ends where ``DataFeed.next_batch`` returns no
    rows: at the end of a ``cluster.train()`` call or of the feed.

    The batches are already made: give a ``DataLoader`` ``batch_size=None``,
    and no worker processes (the feed lives in this process)::

        loader = torch.utils.data.DataLoader(FeedDataset(ctx, 64), batch_size=None)

    :param source: the node's context (``main_fun``'s ``ctx``), or a
        :class:`ember.node.DataFeed`.
    """

    def __init__(self, source: Any, batch_size: int, *, as_dict: bool = False,
                 feed_timeout: float = 600.0) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        super().__init__()
        self._source = source
        self.batch_size = batch_size
        self.as_dict = as_dict
        self.feed_timeout = feed_timeout

    def _feed(self) -> Any:
        if hasattr(self._source, "next_batch"):
            return self._source
        return self._source.get_data_feed(train_mode=True, feed_timeout=self.feed_timeout)

    def __iter__(self) -> Any:
        import warnings

        feed = self._feed()
        while True:
            batch = feed.next_batch(self.batch_size)
            if len(batch) == 0:
                return
            with warnings.catch_warnings():  # "not writable": the feed's memory, shared
                warnings.simplefilter("ignore", UserWarning)
                columns = [torch.from_numpy(c) if isinstance(c, np.ndarray) else c
                           for c in batch.columns]
            if self.as_dict:
                yield dict(zip(batch.names, columns))
            else:
                yield columns[0] if len(columns) == 1 else tuple(columns)

