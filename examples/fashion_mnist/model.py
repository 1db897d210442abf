"""Fashion-MNIST model and Ember node functions (main_fun(args, ctx)).

    train_spark(args, ctx)  InputMode.SPARK: records come from ctx.get_data_feed()
    train_tf(args, ctx)     InputMode.TENSORFLOW: each worker reads its TFRecord shard
    train_stream(args, ctx) InputMode.SPARK from cluster.train_stream: micro-batch by
                            micro-batch, every record trained once
    infer(args, ctx)        inference over the feed with the exported SavedModel

Training is a custom loop whose gradients are summed over the nodes by
Ember's collective (args.collective "ember", the default: _CollectiveTrainer),
or by tf.distribute.MultiWorkerMirroredStrategy ("mwms": _Trainer), which
measured 1.35x (SPARK mode) and 1.8x (TENSORFLOW mode) slower on 2 nodes of 2
cores.  Both input modes take up to STEPS_PER_CALL steps per call (_Loop).  The model is a tf_keras model: Keras 3 does not work under MWMS
(keras-team/keras#20585), so TF_USE_LEGACY_KERAS=1 is set before TensorFlow is
imported.

MWMS has to be created before TensorFlow executes anything in the process (it
configures collective ops on the eager context), so nothing here runs a TF op
at import time, and each training main_fun must run in a fresh process.
"""

import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

NUM_PIXELS = 28 * 28
NUM_CLASSES = 10
TRAIN_RECORDS = 60000
PROGRESS_EVERY = 100
# steps per tf.function call (args.steps_per_call): see _CollectiveTrainer
STEPS_PER_CALL = 10
# floats before the gradients in the collective trainer's allreduce buffer
FLAG_BLOCK = 16

_tf = None


def _import_tf():
    """Import TensorFlow lazily (the driver imports this module too)."""
    global _tf
    if _tf is None:
        import tensorflow as tf

        tf.get_logger().setLevel("ERROR")
        _tf = tf
    return _tf


def build_model():
    """784 -> 256 relu -> 128 relu -> 10 logits (tf_keras Sequential)."""
    _import_tf()
    import tf_keras as keras

    return keras.Sequential(
        [
            keras.Input(shape=(NUM_PIXELS,), dtype="float32", name="image"),
            keras.layers.Dense(256, activation="relu", name="dense_1"),
            keras.layers.Dense(128, activation="relu", name="dense_2"),
            keras.layers.Dense(NUM_CLASSES, name="logits"),
        ],
        name="fashion_mnist_mlp",
    )


def make_optimizer(learning_rate=1e-3):
    """Adam, as TensorFlow's fused kernel (tf_keras's legacy optimizer: one
    ResourceApplyAdam per variable, in place): the newer Keras Adam runs
    about eight elementwise ops with temporaries per variable, and with the
    model's 235,146 weights that took the step of 64 records from 2.7 to
    3.8 ms on one core (docs/performance.md, make bench-train)."""
    import tf_keras as keras

    return keras.optimizers.legacy.Adam(learning_rate=float(learning_rate))


def export_saved_model(tf, model, export_dir):
    """``model`` as a SavedModel whose serving_default signature takes
    ``image`` (float32 [n, 784]) and gives logits, probabilities and classes."""

    @tf.function(input_signature=[tf.TensorSpec([None, NUM_PIXELS], tf.float32, name="image")])
    def serve(image):
        logits = model(image, training=False)
        return {
            "logits": logits,
            "probabilities": tf.nn.softmax(logits),
            "classes": tf.argmax(logits, axis=-1),
        }

    tf.saved_model.save(model, export_dir, signatures={"serving_default": serve})


# ---------------------------------------------------------------- helpers

def _arg(args, name, default=None):
    value = getattr(args, name, None)
    return default if value is None else value


def _report(ctx, text):
    report = getattr(ctx, "report_progress", None)
    if report is not None:
        try:
            report(text)
            return
        except Exception as e:  # progress is best effort; never fail training on it
            print(f"report_progress failed ({e}); {text}", flush=True)
            return
    print(text, flush=True)


def _batch_arrays(batch):
    """Batch -> (float32 (rows, 784) in [0,1], int64 (rows,)), copied.

    The feed hands out zero-copy views that may be reused by the next
    next_batch() call, and TensorFlow may alias numpy memory, so copy."""
    cols = batch.columns
    x = np.array(cols[0], copy=True)
    if x.dtype == np.uint8:
        x = x.astype(np.float32) / 255.0
    elif x.dtype != np.float32:
        x = x.astype(np.float32)
    x = x.reshape(len(batch), NUM_PIXELS)
    y = np.array(cols[1], dtype=np.int64, copy=True).reshape(-1) if len(cols) > 1 else None
    return x, y


def _drain(feed, chunk=4096):
    """Consume what is left of the feed so the Spark feeding side never blocks."""
    drained = 0
    while not feed.should_stop():
        n = len(feed.next_batch(chunk))
        if n == 0:
            break
        drained += n
    return drained


def _configure_threads(tf, args):
    intra = _arg(args, "intra_op_threads")
    inter = _arg(args, "inter_op_threads")
    if intra:
        tf.config.threading.set_intra_op_parallelism_threads(int(intra))
    if inter:
        tf.config.threading.set_inter_op_parallelism_threads(int(inter))


def _make_strategy(tf, args):
    """MultiWorkerMirroredStrategy from TF_CONFIG (exported by Ember).

    Creating it starts this task's gRPC server on its TF_CONFIG port."""
    try:
        _configure_threads(tf, args)
        return tf.distribute.MultiWorkerMirroredStrategy(
            communication_options=tf.distribute.experimental.CommunicationOptions(
                implementation=tf.distribute.experimental.CommunicationImplementation.RING
            )
        )
    except (RuntimeError, ValueError, tf.errors.OpError) as e:
        raise RuntimeError(
            f"cannot create MultiWorkerMirroredStrategy ({e}). It must be the first "
            "TensorFlow work in a fresh process, TF_CONFIG must be set, and this task's "
            f"port must be free (TF_CONFIG={os.environ.get('TF_CONFIG')!r})"
        ) from e


def _is_chief(strategy):
    resolver = strategy.cluster_resolver
    task_type, task_id = resolver.task_type, resolver.task_id
    if task_type is None or task_type == "chief":
        return True
    has_chief = "chief" in resolver.cluster_spec().as_dict()
    return task_type == "worker" and task_id == 0 and not has_chief


class _Trainer:
    """Model, optimizer and the distributed step functions."""

    def __init__(self, tf, strategy, args):
        self.tf = tf
        self.strategy = strategy
        self.replicas = strategy.num_replicas_in_sync
        self.batch_size = int(args.batch_size)
        self.global_batch = self.batch_size * self.replicas

        with strategy.scope():
            self.model = build_model()
            self.optimizer = make_optimizer(_arg(args, "learning_rate", 1e-3))

        model, optimizer, global_batch = self.model, self.optimizer, self.global_batch
        x_spec = tf.TensorSpec([None, NUM_PIXELS], tf.float32, name="image")
        y_spec = tf.TensorSpec([None], tf.int64, name="label")
        flag_spec = tf.TensorSpec([], tf.float32, name="have_next")
        SUM = tf.distribute.ReduceOp.SUM

        def flag_vector(flag):
            # tf.identity: MWMS cannot all-reduce a tf.function input directly
            # ("destinations can not be empty")
            return tf.reshape(tf.identity(flag), [1])

        def step_fn(x, y, have_next):
            with tf.GradientTape() as tape:
                logits = model(x, training=True)
                per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
            grads = tape.gradient(loss, model.trainable_variables)
            # One batched all-reduce carries the gradients and the "I have a
            # batch for the next step" flag: no extra round trip per step.
            reduced = tf.distribute.get_replica_context().all_reduce(
                SUM, list(grads) + [flag_vector(have_next)]
            )
            optimizer.apply_gradients(
                zip(reduced[:-1], model.trainable_variables), experimental_aggregate_gradients=False
            )
            # this worker's mean loss (progress only) and the ready count
            return tf.reduce_mean(per_example), reduced[-1][0]

        @tf.function(input_signature=[x_spec, y_spec, flag_spec])
        def train_step(x, y, have_next):
            loss, ready = strategy.run(step_fn, args=(x, y, have_next))
            local = strategy.experimental_local_results
            return local(loss)[0], local(ready)[0]

        def count_fn(flag):
            return tf.distribute.get_replica_context().all_reduce(SUM, flag_vector(flag))[0]

        @tf.function(input_signature=[flag_spec])
        def ready_count(flag):
            return strategy.experimental_local_results(strategy.run(count_fn, args=(flag,)))[0]

        self._train_step = train_step
        self._ready_count = ready_count

    def _flag(self, have):
        return self.tf.constant(1.0 if have else 0.0)

    def all_have_data(self, have):
        """Collective: True iff every worker passed have=True (used before the
        first step, and with have=True as a barrier)."""
        return int(round(float(self._ready_count(self._flag(have))))) == self.replicas

    def ready_count(self, have):
        """Collective: how many workers passed have=True."""
        return int(round(float(self._ready_count(self._flag(have)))))

    def step(self, x, y, have_next=True):
        """One training step on this worker's batch (x, y); collective.

        have_next says whether this worker has a batch for the step after;
        returns (this worker's mean loss, whether every worker has one), the
        same answer on every worker."""
        loss, ready = self.step_count(x, y, have_next)
        return loss, ready == self.replicas

    def step_count(self, x, y, have_next=True):
        """step(), returning how many workers have a next batch instead."""
        loss, ready = self._train_step(x, y, self._flag(have_next))
        return float(loss), int(round(float(ready)))

    def steps(self, x, y, have_next=True):
        """Consecutive steps on the rows of (x, y), ``args.batch_size`` rows
        each (the last may be shorter); collective.  have_next is for the step
        after the last.  Stops early after a step where some worker had no
        next batch.  Returns (the sum of this worker's step losses, steps
        taken, whether every worker has a next batch)."""
        rows, batch_size = len(y), self.batch_size
        total, done, go = 0.0, 0, True
        for lo in range(0, rows, batch_size):
            hi = min(lo + batch_size, rows)
            loss, go = self.step(x[lo:hi], y[lo:hi], have_next or hi < rows)
            total, done = total + loss, done + 1
            if not go:
                break
        return total, done, go

    def _checkpoint_dir(self, args, chief):
        """The chief checkpoints to model_dir/checkpoint; the others must take
        part (variables may need collectives to read) but write to a private
        temporary directory, deleted by cleanup()."""
        if chief:
            return os.path.join(args.model_dir, "checkpoint")
        if getattr(self, "_tmp", None) is None:
            self._tmp = tempfile.mkdtemp(prefix="ember-fmnist-worker-")
        return os.path.join(self._tmp, "checkpoint")

    def restore(self, args):
        """Restores the latest checkpoint in model_dir (every worker reads the
        chief's); returns its step, 0 when starting fresh."""
        tf = self.tf
        path = tf.train.latest_checkpoint(os.path.join(args.model_dir, "checkpoint"))
        if not path:
            return 0
        tf.train.Checkpoint(model=self.model, optimizer=self.optimizer).restore(path)
        return int(path.rsplit("-", 1)[1])

    def checkpoint(self, args, chief, step):
        """Saves model and optimizer as checkpoint number ``step``; collective."""
        tf = self.tf
        if getattr(self, "_manager", None) is None:
            ckpt = tf.train.Checkpoint(model=self.model, optimizer=self.optimizer)
            self._manager = tf.train.CheckpointManager(
                ckpt, self._checkpoint_dir(args, chief), max_to_keep=2)
        return self._manager.save(checkpoint_number=step)

    def save(self, args, chief, step):
        """Final checkpoint to model_dir/checkpoint and a SavedModel to export_dir."""
        tf, model = self.tf, self.model
        ckpt_path = self.checkpoint(args, chief, step)
        if chief:
            export_dir = args.export_dir
        else:
            export_dir = os.path.join(os.path.dirname(self._checkpoint_dir(args, chief)), "export")

        export_saved_model(tf, model, export_dir)
        return (ckpt_path, export_dir) if chief else (None, None)

    def cleanup(self):
        if getattr(self, "_tmp", None) is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def barrier(self):
        """Collective no-op: returns once every worker got here.

        Used as the last thing in a training main_fun: a worker whose process
        exits (taking its gRPC server and coordination-service heartbeats
        with it) while another is still inside TensorFlow can stall that one
        for the ~10 s heartbeat timeout and make it log 'tasks are unhealthy'."""
        import gc

        gc.collect()  # release datasets/iterators/functions while everyone is still up
        self.all_have_data(True)


class _CollectiveTrainer(_Trainer):
    """The same training on Ember's collective instead of MWMS: each step's
    gradients (and the "I have a next batch" flag) are flattened into one
    float32 tensor, summed over the nodes by ``ember.tf.allreduce`` (shared
    memory between nodes on one host, Ember's ring over TCP across hosts),
    then applied, all in one tf.function call: no copy out of TensorFlow and
    no second call per step.  No TensorFlow collective and no gRPC server;
    rank 0's initial weights are broadcast once.  Checkpoints and exports are
    the same files as the MWMS trainer's."""

    def __init__(self, tf, ctx, args):  # not _Trainer.__init__: that builds MWMS steps
        import ember.tf

        self.tf = tf
        self.ctx = ctx
        self.strategy = None
        self.replicas = ctx.num_workers
        self.batch_size = int(args.batch_size)
        self.global_batch = self.batch_size * self.replicas
        _configure_threads(tf, args)
        self.model = model = build_model()
        self.optimizer = optimizer = make_optimizer(_arg(args, "learning_rate", 1e-3))
        variables = model.trainable_variables
        shapes = [v.shape for v in variables]
        sizes = [int(np.prod(shape)) for shape in shapes]
        global_batch = self.global_batch
        x_spec = tf.TensorSpec([None, NUM_PIXELS], tf.float32, name="image")
        y_spec = tf.TensorSpec([None], tf.int64, name="label")

        flag_spec = tf.TensorSpec([], tf.float32)
        batch_size = self.batch_size
        replicas = float(self.replicas)

        def body(x, y, have_next):
            with tf.GradientTape() as tape:
                per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(
                    labels=y, logits=model(x, training=True))
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
            grads = tape.gradient(loss, variables)
            # the flag leads in a block of FLAG_BLOCK floats so that every
            # part starts 64-byte aligned: TensorFlow's split then hands out
            # views of the summed buffer instead of copying it
            flag = tf.pad(tf.reshape(have_next, [1]), [[0, FLAG_BLOCK - 1]])
            flat = tf.concat([flag] + [tf.reshape(g, [-1]) for g in grads], 0)
            summed = tf.split(ember.tf.allreduce(flat, ctx), [FLAG_BLOCK] + sizes)
            optimizer.apply_gradients(
                [(tf.reshape(g, shape), v) for g, shape, v in zip(summed[1:], shapes, variables)])
            return tf.reduce_mean(per_example), summed[0][0]

        step = tf.function(body, input_signature=[x_spec, y_spec, flag_spec])

        # Several steps in one call, as Keras's steps_per_execution: a
        # tf.function call costs 0.5-0.9 ms of Python and dispatch on a
        # 2-core machine, a 64-record step 2.4 ms (bench-train,
        # docs/performance.md).
        @tf.function(input_signature=[x_spec, y_spec, flag_spec])
        def steps(x, y, have_next):
            rows = tf.shape(y)[0]
            count = (rows + batch_size - 1) // batch_size

            def one(i, total, ready):
                lo = i * batch_size
                flag = tf.where(i + 1 < count, 1.0, have_next)
                loss, ready = body(x[lo:lo + batch_size], y[lo:lo + batch_size], flag)
                return i + 1, total + loss, ready

            # after a step where some worker had no next batch, all stop
            done, total, ready = tf.while_loop(
                lambda i, _total, ready: (i < count) & (ready > replicas - 0.5), one,
                (tf.constant(0), tf.constant(0.0), tf.constant(replicas)))
            return total, done, ready

        self._steps = steps
        self._step = step
        # every node starts from rank 0's weights
        weights = ctx.broadcast(
            np.concatenate([v.numpy().reshape(-1) for v in variables]).astype(np.float32), 0)
        for part, shape, v in zip(np.split(weights, np.cumsum(sizes)[:-1]), shapes, variables):
            v.assign(part.reshape(shape))

    def step_count(self, x, y, have_next=True):
        loss, ready = self._step(x, y, 1.0 if have_next else 0.0)
        return float(loss), int(round(float(ready)))

    def steps(self, x, y, have_next=True):
        total, done, ready = self._steps(x, y, 1.0 if have_next else 0.0)
        return float(total), int(done), int(round(float(ready))) == self.replicas

    def ready_count(self, have):
        return int(round(float(self.ctx.allreduce(np.array([1.0 if have else 0.0],
                                                           np.float32), "sum")[0])))

    def all_have_data(self, have):
        return self.ready_count(have) == self.replicas


def _train_records(args):
    """Training-set size if the job passed it (args.train_records), else None."""
    return _arg(args, "train_records", _arg(args, "num_train"))


def _steps_per_epoch(args, global_batch, num_records):
    spe = _arg(args, "steps_per_epoch")
    return int(spe) if spe else max(1, num_records // global_batch)


class _Loop:
    """What the training loops of both input modes share: several steps per
    call (args.steps_per_call, STEPS_PER_CALL by default), cut so that each
    progress report, epoch end and checkpoint falls between calls on the step
    it names; and those reports (the chief's epoch lines feed MLflow and
    bench-train)."""

    def __init__(self, ctx, args, who, spe, max_steps=None):
        self.ctx, self.who, self.spe, self.max_steps = ctx, who, spe, max_steps
        self.per_call = max(1, int(_arg(args, "steps_per_call", 0) or STEPS_PER_CALL))
        self.every = int(_arg(args, "checkpoint_steps", 0))
        self.loss_sum, self.loss_n = 0.0, 0
        self.epoch_loss, self.epoch_n = 0.0, 0  # this epoch's, for MLflow (ctx.log_metrics)
        self.t_epoch = time.time()

    def room(self, step):
        """How many steps the call starting at ``step`` may take (0: none)."""
        room = self.per_call
        for every in (PROGRESS_EVERY, self.spe, self.every):
            if every:
                room = min(room, every - step % every)
        if self.max_steps is not None:
            room = min(room, self.max_steps - step)
        return max(0, room)

    def stepped(self, step, done, loss_total):
        """Reports after a call that took ``done`` steps, ending at ``step``;
        True when a checkpoint is due."""
        self.loss_sum += loss_total
        self.loss_n += done
        self.epoch_loss += loss_total
        self.epoch_n += done
        ctx, who, spe = self.ctx, self.who, self.spe
        if step % PROGRESS_EVERY == 0:
            _report(ctx, f"{who} epoch {(step - 1) // spe + 1} step {step} "
                         f"loss {self.loss_sum / max(1, self.loss_n):.4f}")
            self.loss_sum, self.loss_n = 0.0, 0
        if step % spe == 0:
            now = time.time()
            _report(ctx, f"{who} epoch {step // spe} done: step {step} {now - self.t_epoch:.2f}s")
            # the job's MLflow run gets the chief's (a no-op without MLFLOW_TRACKING_URI)
            ctx.log_metrics({"loss": self.epoch_loss / max(1, self.epoch_n),
                             "epoch_seconds": now - self.t_epoch}, step=step // spe)
            self.epoch_loss, self.epoch_n = 0.0, 0
            self.t_epoch = now
        return bool(self.every) and step % self.every == 0


def _not_a_trainer(ctx):
    if ctx.job_name in ("chief", "worker"):
        return False
    # MWMS has no parameter servers; an evaluator takes no part in training.
    _report(ctx, f"{ctx.job_name}:{ctx.task_index} has nothing to do under MultiWorkerMirroredStrategy")
    return True


def _start_trainer(args, ctx):
    """TensorFlow, the strategy's _Trainer, whether this worker is the chief,
    and its name in reports."""
    tf = _import_tf()
    who = f"{ctx.job_name}:{ctx.task_index}"
    if _arg(args, "collective", "ember") == "ember":
        return tf, _CollectiveTrainer(tf, ctx, args), ctx.job_name == "chief" or (
            ctx.job_name == "worker" and ctx.task_index == 0 and
            "chief" not in ctx.cluster_spec), who
    strategy = _make_strategy(tf, args)
    return tf, _Trainer(tf, strategy, args), _is_chief(strategy), who


# ---------------------------------------------------------------- InputMode.SPARK

def train_spark(args, ctx):
    """InputMode.SPARK main_fun: train on the records Spark feeds this node.

    The loop runs until any worker's feed runs out (or, if args.steps_per_epoch
    is given, for at most epochs * steps_per_epoch steps).  Each step's gradient
    all-reduce also sums a per-worker "I have my next batch" flag, so all
    workers learn together whether everyone can take another step and stop at
    the same step however unevenly the data is spread (no extra round trip).
    What is left in a worker's feed is then drained.  Nothing is padded; a
    short last batch is trained on as it is (the loss is still divided by the
    global batch size)."""
    if _not_a_trainer(ctx):
        return
    tf, trainer, chief, who = _start_trainer(args, ctx)
    if trainer.replicas != ctx.num_workers:
        _report(ctx, f"{who}: warning: {trainer.replicas} replicas in sync but num_workers={ctx.num_workers}")

    feed = ctx.get_data_feed(train_mode=True)
    batch_size = int(args.batch_size)
    spe = _steps_per_epoch(args, trainer.global_batch, int(_train_records(args) or TRAIN_RECORDS))
    max_steps = int(args.epochs) * spe if _arg(args, "steps_per_epoch") else None

    # After a restart (run(..., max_restarts=K)), continue from the latest checkpoint.
    step = start_step = trainer.restore(args)
    if step:
        _report(ctx, f"{who}: resumed from the checkpoint of step {step}")
    # the driver then feeds only the epochs this checkpoint lacks (whole
    # epochs: the interrupted one again in full)
    ctx.resume_from(step // spe)
    loop = _Loop(ctx, args, who, spe, max_steps)
    records = left = 0
    t0 = time.time()
    # Every worker fetches the batches of its next call before the call and
    # tells the others, inside each step's gradient all-reduce, whether it
    # has a batch for the step after; all of them stop after the first step
    # where any worker did not.
    room = loop.room(step)
    batch = feed.next_batch(room * batch_size) if room else None
    pending = len(batch) if batch is not None else 0  # fetched, not yet trained on
    go = trainer.all_have_data(pending > 0)
    while go:
        rows = pending
        x, y = _batch_arrays(batch)  # a copy: safe to fetch the next batch now
        room = loop.room(step + -(-rows // batch_size))
        batch = feed.next_batch(room * batch_size) if room else None
        pending = len(batch) if batch is not None else 0
        loss_total, done, go = trainer.steps(x, y, pending > 0)
        step += done
        trained_rows = min(rows, done * batch_size)
        records += trained_rows
        left += rows - trained_rows  # a call cut short: the others ran out
        if loop.stepped(step, done, loss_total) and go:
            trainer.checkpoint(args, chief, step)
    elapsed = time.time() - t0
    drained = left + pending + _drain(feed)
    trained = step - start_step
    per_epoch = elapsed * spe / trained if trained else 0.0
    _report(
        ctx,
        f"{who} training done: {trained} steps, {records} records in {elapsed:.1f}s"
        f" ({per_epoch:.1f}s per {spe}-step epoch), {drained} records left over and drained",
    )
    ckpt_path, export_dir = trainer.save(args, chief, step)
    if chief:
        _report(ctx, f"{who} saved checkpoint {ckpt_path} and SavedModel {export_dir}")
    trainer.barrier()
    trainer.cleanup()


# ---------------------------------------------------------------- a stream

def _stream_position_path(args):
    return os.path.join(args.model_dir, "stream-position")


def train_stream(args, ctx):
    """main_fun of ``cluster.train_stream``: trains on each micro-batch of the
    stream as it comes, until the feed ends (``cluster.shutdown()``).

    Within a micro-batch the workers step together while any of them has
    records left (one with none steps on an empty batch), so every record of
    the stream is trained on, none dropped.  Every args.checkpoint_micro_batches
    micro-batches (and at the end) the chief checkpoints with the stream's
    position (``feed.next_micro_batch``, in model_dir/stream-position); after a
    restart, every worker restores it and names it with ``ctx.resume_from``,
    and Ember feeds from there: exactly once."""
    if _not_a_trainer(ctx):
        return
    tf, trainer, chief, who = _start_trainer(args, ctx)
    step = trainer.restore(args)
    position = 0
    if step and os.path.exists(_stream_position_path(args)):
        with open(_stream_position_path(args)) as f:
            position = int(f.read())
        _report(ctx, f"{who}: resumed from the checkpoint of step {step}, micro-batch {position}")
    ctx.resume_from(position)
    feed = ctx.get_data_feed(train_mode=True)
    batch_size = int(args.batch_size)
    every = int(_arg(args, "checkpoint_micro_batches", 0))
    empty = (np.zeros((0, NUM_PIXELS), np.float32), np.zeros((0,), np.int64))

    def checkpoint():
        trainer.checkpoint(args, chief, step)
        if chief:
            with open(_stream_position_path(args) + ".tmp", "w") as f:
                f.write(str(feed.next_micro_batch))
            os.replace(_stream_position_path(args) + ".tmp", _stream_position_path(args))
        ctx.checkpointed(feed.next_micro_batch)

    records, t0 = 0, time.time()
    for micro_batch in feed.micro_batches():
        batch = feed.next_batch(batch_size)
        pending = len(batch)
        go = trainer.ready_count(pending > 0) > 0
        loss_sum, loss_n = 0.0, 0
        while go:
            x, y = _batch_arrays(batch) if pending else empty
            x /= 255.0  # the stream carries raw pixels (main.stream_dataframe)
            records += pending
            batch = feed.next_batch(batch_size) if pending else batch
            pending = len(batch)
            loss, ready = trainer.step_count(x, y, pending > 0)
            go = ready > 0
            step += 1
            loss_sum += loss
            loss_n += 1
        _report(ctx, f"{who} micro-batch {micro_batch}: step {step} "
                     f"loss {loss_sum / max(1, loss_n):.4f}")
        if every and (micro_batch + 1) % every == 0:
            checkpoint()
    _report(ctx, f"{who} training done: {step} steps, {records} records in "
                 f"{time.time() - t0:.1f}s")
    if feed.next_micro_batch is not None and not feed.mid_micro_batch:
        ckpt_path, export_dir = trainer.save(args, chief, step)
        if chief:
            with open(_stream_position_path(args), "w") as f:
                f.write(str(feed.next_micro_batch))
            _report(ctx, f"{who} saved checkpoint {ckpt_path} and SavedModel {export_dir}")
    trainer.barrier()
    trainer.cleanup()


# ---------------------------------------------------------------- InputMode.TENSORFLOW

# Ember's C reader decodes each batch of Examples straight into these columns
# (no tf.train.Example object per record, no parse_example graph op).
_COLUMNS = {"image": ("float32", (NUM_PIXELS,)), "label": "int64"}


def _count_records(files):
    from ember import tfrecord

    return sum(len(b["label"]) for b in tfrecord.reader(files, 8192, {"label": "int64"}))


def train_tf(args, ctx):
    """InputMode.TENSORFLOW main_fun: each worker reads its shard of the TFRecord
    files under args.data_dir/tfrecords/train itself.  The shard is repeated and
    every worker runs exactly epochs * steps_per_epoch steps, where
    steps_per_epoch = args.steps_per_epoch or (record count // global batch)."""
    if _not_a_trainer(ctx):
        return
    from .data import tfrecord_files

    # check inputs before joining the cluster: a worker failing later would
    # leave the others waiting in a collective
    files = tfrecord_files(args.data_dir, "train")
    if not files:
        raise FileNotFoundError(f"no TFRecord files under {os.path.join(args.data_dir, 'tfrecords', 'train')}")

    tf, trainer, chief, who = _start_trainer(args, ctx)
    if _arg(args, "steps_per_epoch"):
        spe = int(args.steps_per_epoch)
    else:
        num_records = _train_records(args)
        if not num_records:  # every worker counts the same files: same answer everywhere
            num_records = _count_records(files)
        spe = _steps_per_epoch(args, trainer.global_batch, int(num_records))

    batch_size = int(args.batch_size)
    from ember import tfrecord

    # this worker's shard (files worker::workers, or records when there are
    # fewer files than workers), endlessly, files in a new order every pass,
    # records shuffled within 10,000-record windows.  Read on this thread,
    # between steps: the reader decodes and shuffles a record in ~3 us
    # (2.5 ms for a call's 640 records against 22 ms of steps), while tf.data's
    # threads (unbatch, shuffle, batch, prefetch) on a node's one core took
    # the step's CPU and halved its rate (bench-train, docs/performance.md).
    batches = tfrecord.reader(files, batch_size, _COLUMNS, shard=ctx, num_epochs=None,
                              shuffle_files=True, shuffle_buffer=10000, seed=ctx.worker_num)

    # After a restart (run(..., max_restarts=K)), continue from the latest checkpoint.
    step = trainer.restore(args)
    if step:
        _report(ctx, f"{who}: resumed from the checkpoint of step {step}")
    total = int(args.epochs) * spe
    loop = _Loop(ctx, args, who, spe, total)
    t0 = time.time()
    while step < total:
        parts = [next(batches) for _ in range(loop.room(step))]
        x = np.concatenate([b["image"] for b in parts])
        y = np.concatenate([b["label"] for b in parts])
        loss_total, done, _ = trainer.steps(x, y)
        step += done
        if loop.stepped(step, done, loss_total) and step < total:
            trainer.checkpoint(args, chief, step)
    _report(ctx, f"{who} training done: {step} steps in {time.time() - t0:.1f}s")
    ckpt_path, export_dir = trainer.save(args, chief, step)
    if chief:
        _report(ctx, f"{who} saved checkpoint {ckpt_path} and SavedModel {export_dir}")
    batches.close()
    trainer.barrier()
    trainer.cleanup()


# ---------------------------------------------------------------- inference

def infer(args, ctx):
    """Inference main_fun: for each fed record (image, label) return the int64
    pair [label, predicted class]; one result per record."""
    tf = _import_tf()
    loaded = tf.saved_model.load(args.export_dir)
    serve = loaded.signatures["serving_default"]
    feed = ctx.get_data_feed(train_mode=False)
    batch_size = int(_arg(args, "infer_batch_size", args.batch_size))
    count = 0
    while True:
        batch = feed.next_batch(batch_size)
        rows = len(batch)
        if rows == 0:
            if feed.should_stop():
                break
            time.sleep(0.01)
            continue
        x, y = _batch_arrays(batch)
        if y is None:
            y = np.full(rows, -1, dtype=np.int64)
        classes = serve(image=tf.constant(x))["classes"].numpy().astype(np.int64)
        feed.batch_results(np.stack([y, classes], axis=1))
        count += rows
    _report(ctx, f"{ctx.job_name}:{ctx.task_index} inferred {count} records")
