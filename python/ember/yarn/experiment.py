"""tf-yarn's experiment kinds, run by one task of ``ember.yarn.run_on_yarn``.

The 5-line version (Keras; ``experiment_fn`` runs inside each YARN container)::

    from ember.yarn import KerasExperiment, run_on_yarn

    def experiment_fn():
        model = build_and_compile_model()             # a compiled Keras 3 model
        return KerasExperiment(model, "hdfs:///user/me/model", {"epochs": 3, "batch_size": 64},
                               input_data_fn=lambda: x, target_data_fn=lambda: y,
                               validation_data_fn=lambda: (x_test, y_test))

and for PyTorch ``PytorchExperiment(model, main_fn, train_dataset,
DataLoaderArgs(batch_size=64, shuffle=True))`` with
``main_fn(model, trainloader, device, rank, tb_writer) -> dict | None``.

Each task (``ember.yarn.task`` in its container, or any Ember node: a Spark
node's ``ctx`` is the same :class:`ember.node.NodeContext`) calls
:func:`run_task`, which dispatches on ``ctx.job_name``:

Keras, ``chief`` / ``worker``
    data-parallel ``model.fit`` over Ember's collective (:mod:`ember.keras`:
    Keras 3 does not work with MultiWorkerMirroredStrategy).  The data
    functions return the FULL data set and every rank takes its shard
    (numpy arrays: rows ``rank::size``, cut to the same length on every
    rank; a ``tf.data.Dataset``: ``shard(size, rank)``), unless
    ``shard_data=False``.  Rank 0 (the chief) saves a checkpoint
    ``<model_dir>/ckpt-<epoch>.keras`` after every epoch and exports the final
    model to ``<model_dir>/export`` (``model.keras``, a TensorFlow SavedModel
    in ``saved_model/``, and ``export.json``); when a checkpoint exists (a
    retried application, ``EMBER_YARN_ATTEMPT`` > 1, or a new run on the same
    ``model_dir``) training resumes from the latest one (its weights and
    optimizer state, ``initial_epoch`` = its epoch).  ``hdfs://`` model dirs
    work (TensorFlow writes a local copy that :mod:`ember.hdfs` uploads).
Keras, ``evaluator``
    evaluates every new checkpoint in ``model_dir`` on
    ``validation_data_fn()``'s data (results also written to
    ``<model_dir>/eval/ckpt-<epoch>.json``) until the chief's export for the
    final epoch (``train_params["epochs"]``) appears; returns the final
    model's metrics.  The evaluator reads what the chief writes: when tasks
    run on different hosts, model_dir must be on a shared file system
    (HDFS), not a container's local disk.
PyTorch, ``chief`` / ``worker``
    ``torch.distributed`` (gloo on CPU, nccl on GPU) from the environment
    (:func:`ember.torch.init_process_group`), a ``DistributedSampler`` over
    ``train_dataset``, a ``DataLoader`` from ``dataloader_args``, the model
    wrapped in ``DistributedDataParallel(**ddp_args)``, then ``main_fn``;
    ``n_workers_per_executor`` > 1 starts that many processes per task
    (global rank ``RANK * n + local``, as tf-yarn's ``task_id * n + n``).
``ps``
    In ``run_on_yarn`` (tf-yarn's ``ps_strategy_topology``) a ps task serves
    a shard of Ember's parameter server (:mod:`ember.ps`) and never reaches
    ``run_task``; a Keras experiment's chief and workers then train
    asynchronously on it (:func:`ember.keras.parameter_servers`; bounded
    staleness with ``EMBER_YARN_PS_STALENESS`` in ``env``), each ending
    with the servers' final weights.  Without ps tasks they average
    gradients on Ember's collective.  A ps node that does reach
    ``run_task`` (a Spark cluster started without ``parameter_servers=``)
    has nothing to serve: it logs that and returns.

:func:`run_task` returns a JSON-able dict: ``task``, ``kind``, ``metrics``
(the final metrics of this task), ``timings`` (seconds) and kind-specific
fields.  This module imports neither TensorFlow nor PyTorch until a task
needs them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import re
import logging
import shutil
import tempfile
import time
import traceback
import uuid
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import numpy as np

from ember import _env, _imports

logger = logging.getLogger("ember.yarn.experiment")

__all__ = ["KerasExperiment", "PytorchExperiment", "DataLoaderArgs",
           "DistributedDataParallelArgs", "run_task", "tensorboard_dir",
           "EVALUATOR_TIMEOUT"]

#: Seconds an evaluator waits without a new checkpoint or export before it
#: gives up (tf-yarn's 20 minutes); ``EMBER_EVALUATOR_TIMEOUT`` overrides it.
EVALUATOR_TIMEOUT = 1200.0

#: Checkpoints kept in ``model_dir`` (older ones are deleted by the chief).
KEEP_CHECKPOINTS = 5

_TRAINERS = ("chief", "worker")
_CKPT_RE = re.compile(r"^ckpt-(\d+)\.keras$")


# ---------------------------------------------------------------- experiment kinds

class KerasExperiment(NamedTuple):
    """A compiled Keras 3 model and its data (tf-yarn's ``KerasExperiment``).

    :param model: a compiled, built ``keras.Model`` (TensorFlow backend;
        build it with ``keras.Input`` or ``model.build``).
    :param model_dir: checkpoints, evaluations and the export go here
        (local path, ``file://`` or ``hdfs://`` URL; relative paths are
        qualified by ``ctx.absolute_path``).
    :param train_params: keyword arguments of ``model.fit`` (``epochs``,
        ``batch_size``, ``steps_per_epoch``, ``callbacks``, ``validation_data``,
        ``x``/``y`` when the data functions are None...).  ``ModelCheckpoint``
        callbacks run on the chief only (as in tf-yarn).
    :param input_data_fn: returns the training inputs (numpy arrays, a dict or
        tuple of them, or a batched ``tf.data.Dataset`` of (x, y)).
    :param target_data_fn: returns the training targets (numpy), or None.
    :param validation_data_fn: returns the evaluator's data: ``(x, y)`` or a
        ``tf.data.Dataset``.
    :param shard_data: the data functions return the full data set and each
        rank keeps its shard (default); False: they already return this
        task's shard (e.g. read ``RANK``/``WORLD_SIZE`` from the environment),
        and every rank must then run the same number of steps per epoch.
    """

    model: Any
    model_dir: str
    train_params: Dict[str, Any]
    input_data_fn: Optional[Callable[[], Any]] = None
    target_data_fn: Optional[Callable[[], Any]] = None
    validation_data_fn: Optional[Callable[[], Any]] = None
    shard_data: bool = True


class DataLoaderArgs(NamedTuple):
    """``torch.utils.data.DataLoader`` arguments (tf-yarn's fields and defaults).

    ``shuffle`` goes to the ``DistributedSampler``.  Keep ``drop_last=True``
    unless every rank gets the same number of full batches: a smaller last
    batch is fine for DDP, but a custom ``main_fn`` collective on tensors
    shaped by the batch would disagree across ranks."""

    batch_size: Optional[int] = 1
    num_workers: int = 0
    pin_memory: bool = False
    drop_last: bool = True
    timeout: float = 0
    prefetch_factor: int = 2
    shuffle: bool = False
    persistent_workers: bool = False
    collate_fn: Optional[Callable[..., Any]] = None


class DistributedDataParallelArgs(NamedTuple):
    """``torch.nn.parallel.DistributedDataParallel`` arguments (tf-yarn's four
    first).  ``device_ids``/``output_device`` default to this process's GPU
    (None on the CPU)."""

    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = False
    device_ids: Optional[List[int]] = None
    output_device: Optional[int] = None


class PytorchExperiment(NamedTuple):
    """A PyTorch model and its training function (tf-yarn's ``PytorchExperiment``,
    same field order).

    :param model: the ``torch.nn.Module`` to train (moved to the device and
        wrapped in DDP by the task).
    :param main_fn: ``main_fn(model, trainloader, device, rank, tb_writer)``:
        the training loop, run on every rank; ``device`` is ``"cpu"`` or
        ``"cuda:<i>"``; ``tb_writer`` a ``torch.utils.tensorboard.SummaryWriter``
        or None when the ``tensorboard`` package is not installed.  A dict it
        returns becomes the task's ``metrics``.  Call
        ``trainloader.sampler.set_epoch(epoch)`` each epoch to reshuffle.
    :param train_dataset: a map-style ``Dataset`` (sharded by a
        ``DistributedSampler``) or an ``IterableDataset`` (which shards itself).
    :param dataloader_args: :class:`DataLoaderArgs`.
    :param n_workers_per_executor: training processes per task.
    :param tensorboard_hdfs_dir: where each rank's TensorBoard events are
        copied at the end (``<dir>/worker<rank>``; hdfs:// or local).
    :param ddp_args: :class:`DistributedDataParallelArgs`.
    """

    model: Any
    main_fn: Callable[..., Any]
    train_dataset: Any
    dataloader_args: DataLoaderArgs = DataLoaderArgs()
    n_workers_per_executor: int = 1
    tensorboard_hdfs_dir: Optional[str] = None
    ddp_args: Optional[DistributedDataParallelArgs] = None


def tensorboard_dir(experiment: Any) -> Optional[str]:
    """The directory a TensorBoard task should watch: a Keras experiment's
    ``model_dir``, a PyTorch experiment's ``tensorboard_hdfs_dir``."""
    if isinstance(experiment, KerasExperiment):
        return experiment.model_dir
    if isinstance(experiment, PytorchExperiment):
        return experiment.tensorboard_hdfs_dir
    return None


# ---------------------------------------------------------------- dispatch

def run_task(experiment_fn: Callable[[], Any], ctx: Any) -> Dict[str, Any]:
    """Runs this task's part of ``experiment_fn()``'s experiment; returns its metrics.

    :param experiment_fn: called here, in the task, after the rendezvous
        (so the model is built in the task): returns a
        :class:`KerasExperiment`, a :class:`PytorchExperiment`, or a plain
        callable ``f(ctx) -> dict | None`` which is called as is.
    :param ctx: the task's :class:`ember.node.NodeContext` (``job_name``
        chief, worker, evaluator or ps).
    :returns: a JSON-able dict (``task``, ``kind``, ``metrics``, ``timings``, ...).
    """
    t0 = time.monotonic()
    job = ctx.job_name
    task = f"{job}:{ctx.task_index}"
    if job == "ps":
        logger.info(f"{task}: Ember's collective averages gradients without a parameter "
                    "server: nothing to serve, the ps task ends")
        return {"task": task, "kind": "ps", "metrics": {}, "timings": {"total_s": 0.0}}
    if job not in _TRAINERS + ("evaluator",):
        raise ValueError(f"run_task: {task} has task type {job!r}; experiments run on "
                         "chief, worker, evaluator and ps tasks")
    attempt = os.environ.get("EMBER_YARN_ATTEMPT", "1")
    experiment = experiment_fn()
    t_made = time.monotonic() - t0
    if isinstance(experiment, KerasExperiment):
        out = _run_keras(experiment, ctx, task)
    elif isinstance(experiment, PytorchExperiment):
        if job == "evaluator":
            raise ValueError(f"run_task: {task}: a PytorchExperiment has no evaluator task "
                             "(as in tf-yarn); evaluate in main_fn on the chief")
        out = _run_pytorch(experiment, ctx, task, experiment_fn)
    elif callable(experiment):
        metrics = experiment(ctx)
        out = {"kind": "callable", "metrics": _jsonable(metrics) if metrics is not None else {}}
    else:
        raise TypeError(f"run_task: experiment_fn() returned {type(experiment).__name__}; "
                        "expected a KerasExperiment, a PytorchExperiment or a callable f(ctx)")
    out["task"] = task
    out["attempt"] = int(attempt) if attempt.isdigit() else attempt
    timings = out.setdefault("timings", {})
    timings["experiment_fn_s"] = round(t_made, 3)
    timings["total_s"] = round(time.monotonic() - t0, 3)
    return out


def _jsonable(value: Any) -> Any:
    """``value`` with numpy/torch scalars and arrays made JSON-able (others: str)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return _jsonable(value.item())
    if isinstance(value, np.ndarray):
        return _jsonable(value.tolist())
    item = getattr(value, "item", None)  # torch / tf scalars
    if callable(item) and getattr(value, "ndim", None) == 0:
        return _jsonable(item())
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return _jsonable(tolist())
    return str(value)


# ---------------------------------------------------------------- model_dir access

class _ModelDir:
    """A model directory on the local file system or HDFS: list, get, put, delete."""

    def __init__(self, url: str) -> None:
        from ember import hdfs

        self.url = url.rstrip("/") or url
        self.remote = hdfs.is_hdfs(self.url)
        if not self.remote:
            if "://" in self.url and not self.url.startswith("file://"):
                raise ValueError(f"model_dir {url!r}: only local paths, file:// and hdfs:// "
                                 "URLs are supported")
            self.local = self.url[len("file://"):] if self.url.startswith("file://") else self.url
        self._hdfs = hdfs

    def path(self, *names: str) -> str:
        if self.remote:
            return self._hdfs.join(self.url, *names)
        return os.path.join(self.local, *names)

    def listdir(self, *sub: str) -> List[str]:
        try:
            if self.remote:
                return self._hdfs.listdir(self.path(*sub))
            return sorted(os.listdir(self.path(*sub)))
        except FileNotFoundError:
            return []

    def exists(self, *names: str) -> bool:
        return self._hdfs.exists(self.path(*names)) if self.remote \
            else os.path.exists(self.path(*names))

    def read_bytes(self, *names: str) -> bytes:
        if self.remote:
            return self._hdfs.read_bytes(self.path(*names))
        with open(self.path(*names), "rb") as f:
            return f.read()

    def write_bytes(self, data: bytes, *names: str) -> None:
        """Writes a file whole, atomically (readers see the old or the new one)."""
        target = self.path(*names)
        if self.remote:
            tmp = f"{target}._COPYING_{uuid.uuid4().hex[:12]}"
            self._hdfs.write_bytes(tmp, data)
            self._hdfs.rename(tmp, target, overwrite=True)
            return
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = f"{os.path.join(os.path.dirname(target), '.' + os.path.basename(target))}" \
              f".{uuid.uuid4().hex[:12]}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, target)

    def get(self, name: str, local: str) -> str:
        """Copies file or directory ``name`` to the local path ``local``."""
        if self.remote:
            return self._hdfs.download(self.path(name), local)
        src = self.path(name)
        if os.path.isdir(src):
            shutil.copytree(src, local, dirs_exist_ok=True)
        else:
            shutil.copyfile(src, local)
        return local

    def put(self, local: str, name: str) -> None:
        """Copies a local file or directory to ``name``, replacing it; readers
        never see a partial copy (written beside it, then renamed)."""
        if self.remote:
            self._hdfs.upload(local, self.path(name), overwrite=True)
            return
        os.makedirs(self.local, exist_ok=True)
        target = self.path(name)
        tmp = os.path.join(self.local, f".{name}.{uuid.uuid4().hex[:12]}.tmp")
        if os.path.isdir(local):
            shutil.copytree(local, tmp)
            if os.path.exists(target):
                shutil.rmtree(target)
            os.rename(tmp, target)
        else:
            shutil.copyfile(local, tmp)
            os.replace(tmp, target)

    def delete(self, name: str) -> None:
        if self.remote:
            self._hdfs.delete(self.path(name), recursive=True)
        elif os.path.isdir(self.path(name)):
            shutil.rmtree(self.path(name), ignore_errors=True)
        else:
            try:
                os.remove(self.path(name))
            except FileNotFoundError:
                pass

    def checkpoints(self) -> Dict[int, str]:
        """{epoch: file name} of the complete checkpoints."""
        out = {}
        for name in self.listdir():
            m = _CKPT_RE.match(name)
            if m:
                out[int(m.group(1))] = name
        return out


def _ckpt_name(epoch: int) -> str:
    return f"ckpt-{epoch:05d}.keras"


# ---------------------------------------------------------------- Keras

def _keras_imports() -> Tuple[Any, Any]:
    if os.environ.get("TF_USE_LEGACY_KERAS", "").lower() in ("1", "true", "yes"):
        raise RuntimeError("KerasExperiment runs Keras 3: unset TF_USE_LEGACY_KERAS in the "
                           "task environment")
    import keras

    import ember.keras

    return keras, ember.keras


def _check_keras_experiment(exp: KerasExperiment, task: str, keras: Any) -> None:
    if not isinstance(exp.model, keras.Model):
        raise TypeError(f"{task}: KerasExperiment.model must be a keras.Model (Keras 3), not "
                        f"{type(exp.model).__module__}.{type(exp.model).__name__}")
    if getattr(exp.model, "optimizer", None) is None:
        raise ValueError(f"{task}: KerasExperiment.model is not compiled: call model.compile()")
    if not exp.model.built:
        raise ValueError(f"{task}: KerasExperiment.model is not built: give it an input "
                         "shape (keras.Input) or call model.build(shape); the replicas "
                         "exchange their weights before the first step")
    if not isinstance(exp.model_dir, str) or not exp.model_dir:
        raise ValueError(f"{task}: KerasExperiment.model_dir must be a path or URL, got "
                         f"{exp.model_dir!r}")
    if not isinstance(exp.train_params, dict):
        raise TypeError(f"{task}: KerasExperiment.train_params must be a dict of model.fit "
                        f"arguments, not {type(exp.train_params).__name__}")
    bad = sorted(set(exp.train_params) & {"initial_epoch", "validation_split"})
    if bad:
        raise ValueError(f"{task}: train_params {bad} are not supported: the initial epoch "
                         "comes from model_dir's checkpoints; pass validation_data instead "
                         "of validation_split")


def _weights_digest(model: Any, keras: Any) -> str:
    h = hashlib.sha256()
    for w in model.weights:
        h.update(np.ascontiguousarray(keras.ops.convert_to_numpy(w)).tobytes())
    return h.hexdigest()


def _run_keras(exp: KerasExperiment, ctx: Any, task: str) -> Dict[str, Any]:
    keras, _ = _keras_imports()
    _check_keras_experiment(exp, task, keras)
    mdir = _ModelDir(ctx.absolute_path(exp.model_dir))
    if ctx.job_name == "evaluator":
        return _keras_evaluate(exp, ctx, task, mdir, keras)
    return _keras_train(exp, ctx, task, mdir, keras)


def _shard_arrays(value: Any, rank: int, size: int, rows: int, what: str) -> Any:
    """Rows ``rank::size`` of every array in ``value`` (an array, or a dict /
    list / tuple of them), ``rows`` rows each."""
    if value is None:
        return None
    if isinstance(value, dict):
        return {k: _shard_arrays(v, rank, size, rows, f"{what}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not (value and np.isscalar(value[0])):
        return type(value)(_shard_arrays(v, rank, size, rows, f"{what}[{i}]")
                           for i, v in enumerate(value))
    if hasattr(value, "shape") and hasattr(value, "__getitem__"):
        return np.asarray(value)[rank::size][:rows]
    raise TypeError(f"{what} is a {type(value).__name__}: the task shards numpy arrays (or "
                    "dicts/tuples of them) and tf.data.Dataset; for other inputs return this "
                    "task's shard and set KerasExperiment(shard_data=False)")


def _num_rows(value: Any) -> List[int]:
    if isinstance(value, dict):
        return [n for v in value.values() for n in _num_rows(v)]
    if isinstance(value, (list, tuple)) and not (value and np.isscalar(value[0])):
        return [n for v in value for n in _num_rows(v)]
    if hasattr(value, "shape") and len(value.shape) > 0:
        return [int(value.shape[0])]
    return []


def _shard_fit_data(x: Any, y: Any, params: Dict[str, Any], rank: int, size: int,
                    task: str) -> Tuple[Any, Any, int]:
    """This rank's shard of (x, y); params may gain ``steps_per_epoch``.
    Returns (x, y, rows in the shard or -1 for a dataset)."""
    import tensorflow as tf

    if isinstance(x, tf.data.Dataset):
        if y is not None:
            raise ValueError(f"{task}: input_data_fn returned a tf.data.Dataset, so "
                             "target_data_fn must return None (the dataset yields (x, y))")
        if "batch_size" in params:
            raise ValueError(f"{task}: batch_size in train_params does not apply to a "
                             "tf.data.Dataset: batch the dataset")
        if "steps_per_epoch" not in params:
            card = int(x.cardinality())
            if card < 0:
                raise ValueError(f"{task}: the dataset's length is unknown or infinite: set "
                                 "train_params['steps_per_epoch'] (every rank must run the "
                                 "same number of steps)")
            if card < size:
                raise ValueError(f"{task}: the dataset has {card} batches, fewer than the "
                                 f"{size} ranks")
            params["steps_per_epoch"] = card // size
        return x.shard(size, rank).repeat(), None, -1
    counts = _num_rows(x) + (_num_rows(y) if y is not None else [])
    if not counts:
        raise TypeError(f"{task}: input_data_fn returned {type(x).__name__}: expected numpy "
                        "arrays (or a dict/tuple of them) or a tf.data.Dataset")
    if len(set(counts)) != 1:
        raise ValueError(f"{task}: the inputs and targets have different numbers of rows: "
                         f"{sorted(set(counts))}")
    n = counts[0]
    rows = n // size
    if rows == 0:
        raise ValueError(f"{task}: {n} training rows cannot be shared by {size} ranks")
    return (_shard_arrays(x, rank, size, rows, "input_data_fn()"),
            _shard_arrays(y, rank, size, rows, "target_data_fn()"), rows)


def _keras_train(exp: KerasExperiment, ctx: Any, task: str, mdir: _ModelDir,
                 keras: Any) -> Dict[str, Any]:
    import ember.keras

    t0 = time.monotonic()
    coll = ctx.collective
    rank, size = coll.rank, coll.size
    chief = rank == 0
    model = exp.model
    params = dict(exp.train_params)
    x = exp.input_data_fn() if exp.input_data_fn is not None else params.pop("x", None)
    y = exp.target_data_fn() if exp.target_data_fn is not None else params.pop("y", None)
    params.pop("x", None)
    params.pop("y", None)
    if x is None:
        raise ValueError(f"{task}: no training data: KerasExperiment.input_data_fn is None "
                         "and train_params has no 'x'")
    rows = -1
    if exp.shard_data:
        x, y, rows = _shard_fit_data(x, y, params, rank, size, task)
    epochs = int(params.pop("epochs", 1))
    user_callbacks = list(params.pop("callbacks", None) or [])
    if not chief:  # tf-yarn: only the chief writes checkpoints
        user_callbacks = [c for c in user_callbacks
                          if not isinstance(c, keras.callbacks.ModelCheckpoint)]
    params.setdefault("verbose", 2)

    # Every rank builds its optimizer now, so that the first broadcast
    # (EmberCallback.on_train_begin) moves the same variables everywhere;
    # the chief then loads the latest checkpoint, which that broadcast spreads.
    if not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)
    initial = np.zeros(1, np.int64)
    tmp = tempfile.mkdtemp(prefix="ember-yarn-keras-")
    try:
        if chief:
            ckpts = mdir.checkpoints()
            if ckpts:
                initial[0] = max(ckpts)
                local = mdir.get(ckpts[int(initial[0])], os.path.join(tmp, "resume.keras"))
                model.load_weights(local)
                logger.info(f"{task}: resuming from {mdir.path(ckpts[int(initial[0])])} "
                            f"(epoch {int(initial[0])}, attempt "
                            f"{os.environ.get('EMBER_YARN_ATTEMPT', '1')})")
                ctx.report_progress(f"{task} resumes at epoch {int(initial[0])}")
        coll.broadcast(initial, 0)
        initial_epoch = int(initial[0])

        # with ps tasks, asynchronous on Ember's parameter servers; else
        # data-parallel on the collective
        callbacks = (ember.keras.parameter_servers(model, ctx) if ctx.cluster_spec.get("ps")
                     else ember.keras.distribute(model, ctx)) + user_callbacks
        if chief:
            callbacks.append(_checkpointer(keras, mdir, tmp, task))
        t_fit = time.monotonic()
        history: Dict[str, List[float]] = {}
        if initial_epoch < epochs:
            h = model.fit(x, y, epochs=epochs, initial_epoch=initial_epoch,
                          callbacks=callbacks, **params)
            history = {k: [float(v) for v in vs] for k, vs in h.history.items()}
        else:
            logger.info(f"{task}: the checkpoint of epoch {initial_epoch} reaches "
                        f"epochs={epochs}: nothing left to train")
        train_s = time.monotonic() - t_fit
        final_epoch = max(initial_epoch, epochs)
        export = None
        if chief:
            export = _keras_export(model, mdir, tmp, final_epoch, task)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "kind": "keras", "rank": rank, "size": size, "initial_epoch": initial_epoch,
        "epochs": final_epoch, "shard_rows": rows, "history": history,
        "metrics": {k: v[-1] for k, v in history.items()},
        "weights_sha256": _weights_digest(model, keras),
        "model_dir": mdir.url, "export": export,
        "timings": {"setup_s": round(t_fit - t0, 3), "train_s": round(train_s, 3)},
    }


def _checkpointer(keras: Any, mdir: _ModelDir, tmp: str, task: str) -> Any:
    """The chief's callback: ``ckpt-<epoch>.keras`` (weights and optimizer
    state) in model_dir after every epoch, the latest KEEP_CHECKPOINTS kept."""

    class EpochCheckpoint(keras.callbacks.Callback):
        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            name = _ckpt_name(epoch + 1)
            local = os.path.join(tmp, name)
            self.model.save(local)
            mdir.put(local, name)
            os.remove(local)
            for old in sorted(mdir.checkpoints())[:-KEEP_CHECKPOINTS]:
                mdir.delete(_ckpt_name(old))

    return EpochCheckpoint()


def _keras_export(model: Any, mdir: _ModelDir, tmp: str, epoch: int, task: str) -> str:
    """``<model_dir>/export``: model.keras, saved_model/ and export.json, put in
    place as a whole (its presence tells the evaluator training is over)."""
    local = os.path.join(tmp, "export")
    os.makedirs(local)
    model.save(os.path.join(local, "model.keras"))
    model.export(os.path.join(local, "saved_model"), format="tf_saved_model", verbose=False)
    with open(os.path.join(local, "export.json"), "w") as f:
        json.dump({"epoch": epoch, "files": ["model.keras", "saved_model"]}, f)
    mdir.put(local, "export")
    url = mdir.path("export")
    logger.info(f"{task}: exported the model of epoch {epoch} to {url}")
    return url


def _keras_evaluate(exp: KerasExperiment, ctx: Any, task: str, mdir: _ModelDir,
                    keras: Any) -> Dict[str, Any]:
    if exp.validation_data_fn is None:
        raise ValueError(f"{task}: the evaluator needs KerasExperiment.validation_data_fn")
    t0 = time.monotonic()
    data = exp.validation_data_fn()
    target = int(exp.train_params.get("epochs", 1))
    batch_size = exp.train_params.get("batch_size")
    model = exp.model
    if not model.optimizer.built:  # so that loading a checkpoint restores every variable
        model.optimizer.build(model.trainable_variables)
    timeout = _env.seconds("EMBER_EVALUATOR_TIMEOUT", EVALUATOR_TIMEOUT)

    def evaluate(local: str) -> Dict[str, float]:
        model.load_weights(local)
        if isinstance(data, tuple):  # (x, y) or (x, y, sample_weight)
            if len(data) not in (2, 3):
                raise ValueError(f"{task}: validation_data_fn returned a tuple of {len(data)}; "
                                 "expected (x, y) or (x, y, sample_weight)")
            result = model.evaluate(data[0], data[1], batch_size=batch_size, verbose=0,
                                    sample_weight=data[2] if len(data) == 3 else None,
                                    return_dict=True)
        else:
            result = model.evaluate(data, verbose=0, return_dict=True)
        return {k: float(v) for k, v in result.items()}

    done: Dict[int, Dict[str, float]] = {}
    for name in mdir.listdir("eval"):  # a retried evaluator skips what it evaluated
        m = re.match(r"^ckpt-(\d+)\.json$", name)
        if m:
            try:
                done[int(m.group(1))] = json.loads(mdir.read_bytes("eval", name))
            except (FileNotFoundError, ValueError):
                pass
    evaluated: List[Dict[str, Any]] = []
    tmp = tempfile.mkdtemp(prefix="ember-yarn-eval-")
    last_progress = time.monotonic()
    eval_s = 0.0
    try:
        while True:
            final = _export_epoch(mdir)
            for epoch, name in sorted(mdir.checkpoints().items()):
                if epoch in done:
                    continue
                t = time.monotonic()
                try:
                    local = mdir.get(name, os.path.join(tmp, name))
                except FileNotFoundError:  # deleted by the chief's retention meanwhile
                    continue
                metrics = evaluate(local)
                os.remove(local)
                eval_s += time.monotonic() - t
                done[epoch] = metrics
                evaluated.append({"epoch": epoch, **metrics})
                mdir.write_bytes(json.dumps(metrics).encode(), "eval", f"ckpt-{epoch:05d}.json")
                logger.info(f"{task}: epoch {epoch}: "
                            + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
                last_progress = time.monotonic()
            if final is not None and final >= target:
                if final in done:
                    metrics = done[final]
                else:  # its checkpoint is gone (or was never written): the export itself
                    local = mdir.get("export", os.path.join(tmp, "export"))
                    metrics = evaluate(os.path.join(local, "model.keras"))
                    evaluated.append({"epoch": final, **metrics})
                logger.info(f"{task}: final model (epoch {final}): "
                            + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
                return {"kind": "keras", "epochs": final, "metrics": metrics,
                        "evaluations": evaluated, "model_dir": mdir.url,
                        "timings": {"evaluate_s": round(eval_s, 3),
                                    "wall_s": round(time.monotonic() - t0, 3)}}
            if time.monotonic() - last_progress > timeout:
                raise TimeoutError(
                    f"{task}: no new checkpoint in {mdir.url} and no export of epoch "
                    f"{target} for {timeout:.0f} s (EMBER_EVALUATOR_TIMEOUT); did the "
                    "chief fail?")
            time.sleep(1.0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _export_epoch(mdir: _ModelDir) -> Optional[int]:
    """The epoch of the export in model_dir, None if there is none (yet)."""
    try:
        info = json.loads(mdir.read_bytes("export", "export.json"))
        return int(info["epoch"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


# ---------------------------------------------------------------- PyTorch

def _run_pytorch(exp: PytorchExperiment, ctx: Any, task: str,
                 experiment_fn: Callable[[], Any]) -> Dict[str, Any]:
    n = exp.n_workers_per_executor
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"{task}: n_workers_per_executor must be a positive int, got {n!r}")
    if not callable(exp.main_fn):
        raise TypeError(f"{task}: PytorchExperiment.main_fn must be callable")
    if not isinstance(exp.dataloader_args, DataLoaderArgs):
        raise TypeError(f"{task}: dataloader_args must be a DataLoaderArgs, not "
                        f"{type(exp.dataloader_args).__name__}")
    if exp.ddp_args is not None and not isinstance(exp.ddp_args, DistributedDataParallelArgs):
        raise TypeError(f"{task}: ddp_args must be a DistributedDataParallelArgs, not "
                        f"{type(exp.ddp_args).__name__}")
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(key):
            raise RuntimeError(f"{task} has no {key} in its environment (set by Ember's "
                               "rendezvous on chief and worker tasks)")
    tb_url = ctx.absolute_path(exp.tensorboard_hdfs_dir) if exp.tensorboard_hdfs_dir else None
    if n == 1:
        return _torch_train(exp, ctx, task, int(os.environ["RANK"]),
                            int(os.environ["WORLD_SIZE"]), 0, tb_url)
    return _torch_spawn(experiment_fn, ctx, task, n, tb_url)


def _torch_train(exp: PytorchExperiment, ctx: Any, task: str, rank: int, world: int,
                 local_rank: int, tb_url: Optional[str]) -> Dict[str, Any]:
    """One training process: ``ctx`` is the task's (its framework port is
    released for torch's store) or None in a process of n_workers_per_executor."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

    import ember.torch

    t0 = time.monotonic()
    cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
    gpu = local_rank % torch.cuda.device_count() if cuda else None
    device = f"cuda:{gpu}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(gpu)
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
    os.environ["LOCAL_RANK"] = str(local_rank)
    ember.torch.init_process_group(ctx, backend="nccl" if cuda else "gloo")
    tb_local = tempfile.mkdtemp(prefix="ember-yarn-tb-")
    try:
        model = exp.model.to(device)
        ddp_kwargs = (exp.ddp_args or DistributedDataParallelArgs())._asdict()
        if cuda and ddp_kwargs["device_ids"] is None:
            ddp_kwargs["device_ids"] = [gpu]
        ddp = DDP(model, **ddp_kwargs)

        args = exp.dataloader_args
        dataset = exp.train_dataset
        sampler = None
        if not isinstance(dataset, IterableDataset):
            sampler = DistributedSampler(dataset, num_replicas=world, rank=rank,
                                         shuffle=args.shuffle)
        loader_kwargs: Dict[str, Any] = dict(
            batch_size=args.batch_size, sampler=sampler, num_workers=args.num_workers,
            pin_memory=args.pin_memory, drop_last=args.drop_last, timeout=args.timeout,
            collate_fn=args.collate_fn)
        if args.num_workers > 0:  # torch refuses these without worker processes
            loader_kwargs.update(prefetch_factor=args.prefetch_factor,
                                 persistent_workers=args.persistent_workers)
        loader = DataLoader(dataset, **loader_kwargs)

        tb_writer = None
        try:
            from torch.utils.tensorboard import SummaryWriter
            tb_writer = SummaryWriter(tb_local)
        except ImportError as exc:
            logger.warning(f"{task}: no TensorBoard writer for main_fn (tb_writer=None): "
                           f"{exc}; install tensorboard in the task's environment")
        t_main = time.monotonic()
        result = exp.main_fn(ddp, loader, device, rank, tb_writer)
        main_s = time.monotonic() - t_main
        if tb_writer is not None:
            tb_writer.flush()
            tb_writer.close()
            if tb_url:
                _ModelDir(tb_url).put(tb_local, f"worker{rank}")
        dist.destroy_process_group()
    finally:
        shutil.rmtree(tb_local, ignore_errors=True)
    metrics = _jsonable(result) if isinstance(result, dict) else {}
    if result is not None and not isinstance(result, dict):
        logger.warning(f"{task}: main_fn returned a {type(result).__name__}, not a dict: not "
                       "reported (return a dict of metrics)")
    return {"kind": "pytorch", "rank": rank, "world_size": world, "local_rank": local_rank,
            "device": device, "metrics": metrics,
            "tensorboard": tb_writer is not None,
            "timings": {"setup_s": round(t_main - t0, 3), "main_fn_s": round(main_s, 3)}}


def _torch_spawn(experiment_fn: Callable[[], Any], ctx: Any, task: str, n: int,
                 tb_url: Optional[str]) -> Dict[str, Any]:
    """``n`` training processes for this task: global rank ``RANK * n + i``."""
    import multiprocessing

    node_rank, node_world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    world = node_world * n
    # the processes rebuild the experiment themselves (as tf-yarn's do): the
    # model and dataset need not pickle; experiment_fn itself must
    payload = _imports.cloudpickle().dumps(experiment_fn)
    ctx.release_port()  # the chief's local rank 0 binds MASTER_PORT for torch's store
    mp = multiprocessing.get_context("spawn")
    queue = mp.Queue()
    procs = []
    for i in range(n):
        p = mp.Process(target=_torch_child, name=f"{task}/{i}",
                       args=(payload, task, node_rank * n + i, world, i, queue, tb_url),
                       daemon=False)
        p.start()
        procs.append(p)
    results: Dict[int, Any] = {}
    failure = None
    while len(results) < n and failure is None:
        try:
            i, ok, value = queue.get(timeout=1.0)
        except Exception:  # queue.Empty: check for processes that died without a word
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                failure = f"{dead[0].name} exited with code {dead[0].exitcode}"
            continue
        if ok:
            results[i] = value
        else:
            failure = f"{task} local process {i}:\n{value}"
    if failure is not None:
        for p in procs:
            if p.is_alive():
                p.terminate()
    for p in procs:
        p.join()
    if failure is not None:
        raise RuntimeError(f"{task}: a training process failed: {failure}")
    out = dict(results[0])  # local rank 0 speaks for the task; every process listed
    out["processes"] = [results[i] for i in range(n)]
    return out


def _torch_child(payload: bytes, task: str, rank: int, world: int, local_rank: int,
                 queue: Any, tb_url: Optional[str]) -> None:
    """A process of n_workers_per_executor: rebuilds the experiment and trains."""
    _imports.pause_collector_on_heavy_imports()  # a process Ember starts, as its task is
    try:
        experiment_fn = pickle.loads(payload)
        exp = experiment_fn()
        if not isinstance(exp, PytorchExperiment):
            raise TypeError(f"experiment_fn() returned {type(exp).__name__} in a spawned "
                            "process, not a PytorchExperiment")
        out = _torch_train(exp, None, f"{task}/{local_rank}", rank, world, local_rank, tb_url)
        queue.put((local_rank, True, out))
    except BaseException:
        queue.put((local_rank, False, traceback.format_exc()))
        raise SystemExit(1)
