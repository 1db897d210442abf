"""Keras 3 ``model.fit`` on several nodes: gradients averaged on Ember's collective.

Keras 3 (the default since TensorFlow 2.16) does not work with
MultiWorkerMirroredStrategy (keras-team/keras#20585).  With Ember, plain
single-worker Keras code trains data-parallel on every chief/worker node::

    import keras
    import ember.keras

    def main_fun(args, ctx):
        model = build_model()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        callbacks = ember.keras.distribute(model, ctx)   # the only new line
        model.fit(my_shard_of_the_data, epochs=3, callbacks=callbacks)

``distribute`` makes the model's optimizer average each step's gradients over
all ranks (:func:`DistributedOptimizer`, one allreduce of all gradients
flattened into one buffer per dtype) and returns a :class:`EmberCallback` that
broadcasts rank 0's weights when training begins (so the replicas start equal
and, with equal averaged gradients, stay bit-identical) and averages the epoch
logs (so every node's History shows the global loss and metrics).

Every rank must run the same number of steps per epoch (equal shards, or
``steps_per_epoch``); a rank that runs ahead meets a different collective and
fails with an error rather than hanging.  The TensorFlow backend is supported
(``KERAS_BACKEND=tensorflow``, the default); XLA compilation is turned off for
the train step, which calls into the collective.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from ember.collective import collective_of

if os.environ.get("TF_USE_LEGACY_KERAS", "").lower() in ("1", "true", "yes"):
    raise ImportError("ember.keras is for Keras 3; TF_USE_LEGACY_KERAS is set in this process "
                      "(unset it before TensorFlow is imported)")

import keras  # noqa: E402

if not keras.__version__.startswith("3."):
    raise ImportError(f"ember.keras needs Keras 3, found keras {keras.__version__}")

__all__ = ["distribute", "DistributedOptimizer", "EmberCallback", "allreduce_gradients",
           "broadcast_variables"]


def _check_backend() -> None:
    backend = keras.backend.backend()
    if backend != "tensorflow":
        raise ValueError(f"ember.keras supports the TensorFlow backend of Keras 3 "
                         f"(KERAS_BACKEND=tensorflow), not {backend!r}")


# ---------------------------------------------------------------- gradients

def allreduce_gradients(grads: Sequence[Any], ctx: Any, op: str = "avg") -> List[Any]:
    """Averages (``op``) a list of TensorFlow gradients over all ranks.

    Works inside ``tf.function`` (the call is a ``tf.numpy_function``) and
    eagerly.  None entries stay None (every rank has the same structure);
    IndexedSlices become dense.  The gradients are packed into one contiguous
    buffer per dtype (float64 stays float64, every other float type travels
    as float32), so a step costs one or two allreduce calls whatever the
    number of variables.
    """
    import tensorflow as tf

    coll = collective_of(ctx)
    out: List[Any] = list(grads)
    groups: Dict[Any, List[int]] = {}
    for i, g in enumerate(out):
        if g is None:
            continue
        if isinstance(g, tf.IndexedSlices):
            g = out[i] = tf.convert_to_tensor(g)
        wire = tf.float64 if g.dtype == tf.float64 else tf.float32
        if not (g.dtype.is_floating or g.dtype == wire):
            raise TypeError(f"gradient {i} has dtype {g.dtype.name}; only floating point "
                            "gradients are averaged")
        groups.setdefault(wire, []).append(i)

    def reduce(buf: np.ndarray) -> np.ndarray:
        buf = np.require(buf, requirements=["C", "W"])  # numpy_function may pass read-only
        coll.allreduce(buf, op)
        return buf

    for wire, idx in groups.items():
        parts = [tf.reshape(tf.cast(out[i], wire), [-1]) for i in idx]
        flat = tf.concat(parts, 0) if len(parts) > 1 else parts[0]
        reduced = tf.numpy_function(reduce, [flat], wire, stateful=True,
                                    name="ember_allreduce")
        reduced.set_shape(flat.shape)
        sizes = [int(np.prod(out[i].shape)) if out[i].shape.is_fully_defined()
                 else tf.size(out[i]) for i in idx]
        pieces = tf.split(reduced, sizes) if len(idx) > 1 else [reduced]
        for i, piece in zip(idx, pieces):
            out[i] = tf.cast(tf.reshape(piece, tf.shape(out[i])), out[i].dtype)
    return out


def DistributedOptimizer(optimizer: Any, ctx: Any) -> Any:
    """Makes a Keras 3 optimizer average gradients over all ranks before each update.

    The same optimizer object is returned (its class becomes a subclass whose
    ``apply`` first calls :func:`allreduce_gradients`), so its variables,
    config and the model's reference to it stay as they are.  Pass it to
    ``model.compile`` or apply it to ``model.optimizer`` after compiling.
    """
    _check_backend()
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"expected a keras.optimizers.Optimizer, not {type(optimizer).__name__}")
    coll = collective_of(ctx)
    if getattr(optimizer, "_ember_collective", None) is not None:
        optimizer._ember_collective = coll
        return optimizer
    base = type(optimizer)

    def apply(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
        grads = allreduce_gradients(list(grads), self._ember_collective)
        return base.apply(self, grads, trainable_variables)

    cls = type(base.__name__, (base,), {"apply": apply, "__module__": base.__module__,
                                        "__doc__": base.__doc__})
    optimizer.__class__ = cls
    optimizer._ember_collective = coll
    return optimizer


# ---------------------------------------------------------------- weights

def broadcast_variables(variables: Sequence[Any], ctx: Any, root: int = 0) -> None:
    """Assigns rank ``root``'s values to ``variables`` on every rank (one
    broadcast of all of them packed as bytes)."""
    coll = collective_of(ctx)
    variables = list(variables)
    if not variables:
        return
    arrays = [np.ascontiguousarray(keras.ops.convert_to_numpy(v)) for v in variables]
    nbytes = [a.nbytes for a in arrays]
    packed = np.empty(sum(nbytes), dtype=np.uint8)
    offset = 0
    for a, n in zip(arrays, nbytes):
        packed[offset:offset + n] = a.reshape(-1).view(np.uint8)
        offset += n
    coll.broadcast(packed, root)
    if coll.rank == root:
        return
    offset = 0
    for v, a, n in zip(variables, arrays, nbytes):
        # v.shape, not a.shape: ascontiguousarray makes a scalar (the
        # optimizer's iteration count) 1-d
        v.assign(packed[offset:offset + n].view(a.dtype).reshape(tuple(v.shape)))
        offset += n


class EmberCallback(keras.callbacks.Callback):
    """Keeps the replicas of a model in step during ``model.fit``.

    - on train begin: turns XLA off for the train step if it was on (the
      step calls the collective), broadcasts rank ``root``'s model weights
      (and optimizer variables, when already built) to every rank;
    - on epoch end: averages the non-trainable floating point weights (e.g.
      BatchNormalization statistics, which each rank computes on its own
      data) when ``average_non_trainable``, and the logs (loss, metrics,
      validation metrics) when ``average_logs``.
    """

    def __init__(self, ctx: Any, root: int = 0, average_logs: bool = True,
                 average_non_trainable: bool = True) -> None:
        super().__init__()
        self._coll = collective_of(ctx)
        self.root = root
        self.average_logs = average_logs
        self.average_non_trainable = average_non_trainable

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        model = self.model
        if getattr(model, "jit_compile", False):
            model.jit_compile = False
            model.make_train_function(force=True)
        variables = list(model.weights)
        opt = getattr(model, "optimizer", None)
        if opt is not None and getattr(opt, "built", False):
            variables += list(opt.variables)
        broadcast_variables(variables, self._coll, self.root)

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if self.average_non_trainable:
            weights = [w for w in self.model.non_trainable_weights
                       if np.dtype(keras.backend.standardize_dtype(w.dtype)).kind == "f"]
            if weights:
                values = allreduce_gradients([w.value for w in weights], self._coll)
                for w, v in zip(weights, values):
                    w.assign(v)
        if self.average_logs and logs:
            keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0)
            averages = np.array([float(logs[k]) for k in keys], dtype=np.float64)
            self._coll.allreduce(averages, "avg")
            for k, v in zip(keys, averages):
                logs[k] = float(v)


def distribute(model: Any, ctx: Any, root: int = 0, **callback_kwargs: Any) -> List[Any]:
    """Makes a compiled Keras 3 model train data-parallel over the Ember
    collective; returns the callbacks to pass to ``model.fit``.

    :param model: a compiled ``keras.Model`` (TensorFlow backend).
    :param ctx: the node's ``ctx`` (or an ``ember.collective.Collective``).
    :param root: the rank whose initial weights every rank starts from.
    :param callback_kwargs: passed to :class:`EmberCallback`.
    """
    _check_backend()
    if getattr(model, "optimizer", None) is None:
        raise ValueError("distribute() needs a compiled model: call model.compile() first")
    DistributedOptimizer(model.optimizer, ctx)
    return [EmberCallback(ctx, root=root, **callback_kwargs)]


# ---------------------------------------------------------------- parameter servers

#: Keras optimizers the parameter servers apply themselves (ember/ps.h)
_PS_OPTIMIZERS = {"SGD": "sgd", "Adagrad": "adagrad", "Adam": "adam"}


def _ps_optimizer(optimizer: Any) -> Dict[str, Any]:
    """The parameter servers' version of a Keras optimizer: what ``declare``
    takes, or ValueError naming what the servers cannot apply."""
    name = type(optimizer).__name__
    kind = _PS_OPTIMIZERS.get(name)
    if kind is None:
        raise ValueError(f"the parameter servers apply SGD (with momentum), Adagrad and Adam; "
                         f"the model's optimizer is {name}")
    cfg = optimizer.get_config()
    for key in ("weight_decay", "clipnorm", "global_clipnorm", "clipvalue",
                "gradient_accumulation_steps", "loss_scale_factor"):
        if cfg.get(key):
            raise ValueError(f"{name}({key}={cfg[key]!r}) is applied on the workers by Keras, "
                             "not by the parameter servers: leave it unset")
    if cfg.get("use_ema") or cfg.get("nesterov") or cfg.get("amsgrad"):
        raise ValueError(f"{name}: EMA, Nesterov momentum and AMSGrad are not applied by the "
                         "parameter servers")
    lr = cfg["learning_rate"]
    if not isinstance(lr, (int, float)):
        raise ValueError(f"{name}: a learning-rate schedule is not applied by the parameter "
                         "servers; give a number")
    out: Dict[str, Any] = dict(optimizer=kind, learning_rate=float(lr))
    if kind == "sgd" and cfg.get("momentum"):
        out.update(optimizer="momentum", momentum=float(cfg["momentum"]))
    elif kind == "adagrad":
        out.update(initial_accumulator=float(cfg["initial_accumulator_value"]),
                   epsilon=float(cfg["epsilon"]))
    elif kind == "adam":
        out.update(beta1=float(cfg["beta_1"]), beta2=float(cfg["beta_2"]),
                   epsilon=float(cfg["epsilon"]))
    return out


def _table_shape(shape: Sequence[int]) -> tuple:
    """A variable's shape as the servers' rows x cols (the first axis the rows)."""
    dims = [int(d) for d in shape]
    if not dims:
        return 1, 1
    return dims[0], int(np.prod(dims[1:])) if len(dims) > 1 else 1


def _ps_lookup(client: Any, table: str, dim: int, ids: Any, anchor: Any) -> Any:
    """The rows of sparse table ``table`` for ``ids`` (any shape), pulled for
    the batch's distinct ids; the backward pass pushes their gradients,
    summed per row.  ``anchor`` is a scalar 0 read from a trainable variable:
    it puts the pulled rows on a path from one, as the gradient tape needs
    to reach the push; its gradient is 0."""
    import tensorflow as tf

    ids = tf.cast(ids, tf.int64)
    unique, where = tf.unique(tf.reshape(ids, [-1]))

    def pull(rows: np.ndarray) -> np.ndarray:
        return client.pull(table, np.ascontiguousarray(rows, dtype=np.uint64), dim)

    def push(rows: np.ndarray, grads: np.ndarray) -> np.int64:
        client.push(table, np.ascontiguousarray(rows, dtype=np.uint64),
                    np.ascontiguousarray(grads, dtype=np.float32))
        return np.int64(0)

    @tf.custom_gradient
    def lookup(rows_ids: Any, anchor_value: Any) -> Any:
        values = tf.numpy_function(pull, [rows_ids], tf.float32, stateful=True,
                                   name="ember_ps_pull")
        values.set_shape([None, dim])

        def grad(upstream: Any) -> Any:
            # the gather below already summed a repeated id's gradients
            done = tf.numpy_function(push, [rows_ids, tf.cast(upstream, tf.float32)],
                                     tf.int64, stateful=True, name="ember_ps_push")
            with tf.control_dependencies([done]):
                return None, tf.zeros_like(anchor_value)
        return values + tf.cast(anchor_value, tf.float32), grad

    rows = lookup(unique, anchor)
    out = tf.gather(rows, where)
    return tf.reshape(out, tf.concat([tf.shape(ids), [dim]], 0))


def _anchor(layer: Any) -> Any:
    """A layer's zero scalar for :func:`_ps_lookup`, which the servers never see."""
    anchor = layer.add_weight(shape=(), initializer="zeros", trainable=True, name="ps_anchor")
    anchor._ember_ps_skip = True
    return anchor


def _embedding_on_servers(layer: Any, model_name: str, client: Any,
                          spec: Dict[str, Any]) -> None:
    """Makes a ``keras.layers.Embedding`` of a model row-sparse on the
    servers: its table is declared there (the model's optimizer; rows
    uniform in [-0.05, 0.05), Keras's default), its calls pull and push rows
    through :func:`_ps_lookup`, and its own weights are left out (they stay
    allocated but unused: a table larger than a worker's memory needs
    :class:`PsEmbedding`)."""
    if getattr(layer, "_ember_ps_table", None) is not None:
        return
    if getattr(layer, "embeddings_regularizer", None) is not None or \
            getattr(layer, "embeddings_constraint", None) is not None or \
            getattr(layer, "lora_enabled", False):
        raise ValueError(f"{layer.name}: an Embedding with a regularizer, a constraint or LoRA "
                         "cannot live on the parameter servers")
    table = f"{model_name}/{layer.name}/embeddings"
    client.declare(table, "sparse", int(layer.input_dim), int(layer.output_dim),
                   init="uniform", init_scale=0.05, **spec)
    layer.embeddings._ember_ps_skip = True
    dim = int(layer.output_dim)
    layer._ember_ps_table = table

    def call(inputs: Any) -> Any:
        import tensorflow as tf

        # a built layer takes no new variable: one element of its own
        # (unused) table, gathered, is the anchor; its gradient is one row
        anchor = tf.gather(layer.embeddings, [0])[0, 0] * 0.0
        return _ps_lookup(client, table, dim, inputs, anchor)

    layer.call = call


class PsEmbedding(keras.layers.Layer):
    """An embedding table that lives on the parameter servers, row-sparse.

    A drop-in for ``keras.layers.Embedding`` in a model trained with
    :func:`parameter_servers`: a batch pulls only the rows its ids name and
    pushes only their gradients, so the table may be far larger than a
    worker's memory (``input_dim`` of 10**9 costs the rows a job touches).
    The servers apply ``optimizer`` to it (Adagrad, the usual choice for
    embeddings; also "sgd", "momentum", "adam") and initialise each row from
    a normal distribution of standard deviation ``init_scale``.
    """

    def __init__(self, input_dim: int, output_dim: int, optimizer: str = "adagrad",
                 learning_rate: float = 0.05, init_scale: float = 0.05, seed: int = 0,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.input_dim, self.output_dim = int(input_dim), int(output_dim)
        self.ps_optimizer = dict(optimizer=optimizer, learning_rate=float(learning_rate))
        self.init_scale, self.seed = float(init_scale), int(seed)
        self._client: Any = None  # set by parameter_servers()
        self.anchor = _anchor(self)  # see _ps_lookup

    @property
    def table(self) -> str:
        return f"{self.name}/embeddings"

    def bind(self, client: Any) -> None:
        """Declares the table on the servers (idempotent) and pulls through ``client``."""
        client.declare(self.table, "sparse", self.input_dim, self.output_dim,
                       init="normal", init_scale=self.init_scale, seed=self.seed,
                       **self.ps_optimizer)
        self._client = client

    def call(self, ids: Any) -> Any:
        if self._client is None:
            raise RuntimeError(f"{self.name}: call ember.keras.parameter_servers(model, ctx) "
                               "before training or predicting")
        return _ps_lookup(self._client, self.table, self.output_dim, ids, self.anchor)

    def compute_output_shape(self, input_shape: Any) -> Any:
        return (*input_shape, self.output_dim)


def parameter_servers(model: Any, ctx: Any, client: Any = None) -> List[Any]:
    """Makes a compiled Keras 3 model train asynchronously on the cluster's
    parameter servers (``run(..., num_ps=k, parameter_servers=...)``);
    returns the callbacks to pass to ``model.fit`` (a :class:`PsCallback`:
    at the end every worker holds the servers' final weights).

    Every trainable variable becomes a dense table on the servers, split
    over them by rows, and every :class:`PsEmbedding` and
    ``keras.layers.Embedding`` a row-sparse one (a batch moves only the rows
    its ids name; an Embedding's table gets the model's optimizer).  The
    chief puts its initial weights there; then each step of every worker
    pushes its gradients (the servers apply the model's optimizer: SGD with
    or without momentum, Adagrad or Adam, with their state kept per row on
    the servers), counts a step (bounded staleness, if configured) and
    pulls the current weights, without waiting for the other workers.

    :param model: a compiled ``keras.Model`` (TensorFlow backend).
    :param ctx: the node's ``ctx`` (the chief or a worker).
    :param client: an :class:`ember.ps.Client` (default ``ctx.parameter_servers()``).
    """
    import tensorflow as tf

    _check_backend()
    if getattr(model, "optimizer", None) is None:
        raise ValueError("parameter_servers() needs a compiled model: call model.compile() first")
    client = client if client is not None else ctx.parameter_servers()
    coll = collective_of(ctx)
    spec = _ps_optimizer(model.optimizer)
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, PsEmbedding):
            layer.bind(client)
        elif isinstance(layer, keras.layers.Embedding):
            _embedding_on_servers(layer, model.name, client, spec)
    variables = [v for v in model.trainable_variables if not getattr(v, "_ember_ps_skip", False)]
    tables = []
    for v in variables:
        rows, cols = _table_shape(v.shape)
        name = f"{model.name}/{v.path}"
        client.declare(name, "dense", rows, cols, **spec)
        tables.append((name, rows, cols, tuple(int(d) for d in v.shape)))
    if client.worker == 0:  # the chief's initial weights are the model's
        for v, (name, rows, cols, _) in zip(variables, tables):
            value = np.asarray(keras.ops.convert_to_numpy(v), dtype=np.float32)
            # rows a restored checkpoint trained keep their values
            client.initialize(name, None, value.reshape(rows, cols))
    coll.barrier()
    for v, (name, _, cols, shape) in zip(variables, tables):
        v.assign(client.pull(name, None, cols).reshape(shape))
    # nobody pushes before everyone pulled: every worker starts from the same weights
    coll.barrier()

    def step(*grads: np.ndarray) -> List[np.ndarray]:
        for (name, rows, cols, _), g in zip(tables, grads):
            client.push(name, None, np.ascontiguousarray(g, dtype=np.float32).reshape(rows, cols))
        client.clock()
        return [client.pull(name, None, cols).reshape(shape) for name, _, cols, shape in tables]

    optimizer = model.optimizer
    base = type(optimizer)

    def apply(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
        given = {v.path: g for g, v in zip(grads, trainable_variables or variables)}
        # in the tables' order; a variable without a gradient pushes zeros
        dense = [tf.cast(tf.convert_to_tensor(given[v.path]), tf.float32)
                 if given.get(v.path) is not None else tf.zeros(v.shape, tf.float32)
                 for v in variables]
        new = tf.numpy_function(step, dense, [tf.float32] * len(dense), stateful=True,
                                name="ember_ps_step")
        for v, value in zip(variables, new):
            v.assign(tf.cast(tf.reshape(value, v.shape), v.dtype))
        self.iterations.assign_add(1)

    cls = type(base.__name__, (base,), {"apply": apply, "__module__": base.__module__,
                                        "__doc__": base.__doc__})
    optimizer.__class__ = cls
    if getattr(model, "jit_compile", False):  # the step calls out to the servers
        model.jit_compile = False
    model.make_train_function(force=True)
    return [PsCallback(client, coll, variables, tables)]


class PsCallback(keras.callbacks.Callback):
    """The end of ``model.fit`` on the parameter servers: this worker tells
    them it finished (so bounded staleness holds nobody back for it), waits
    for the other workers, and pulls the final weights, so that every worker
    ends with the model the servers hold (what an asynchronous job trained),
    not with the weights of its own last step.  Made by
    :func:`parameter_servers`."""

    def __init__(self, client: Any, coll: Any, variables: List[Any], tables: List[Any]) -> None:
        super().__init__()
        self._client, self._coll = client, coll
        self._variables, self._tables = variables, tables

    def on_train_end(self, logs: Optional[Dict[str, Any]] = None) -> None:
        self._client.finish()
        self._coll.barrier()
        for v, (name, _, cols, shape) in zip(self._variables, self._tables):
            v.assign(self._client.pull(name, None, cols).reshape(shape))
