"""make bench-inference: distributed batched inference on one local Spark.

The Fashion-MNIST test set x20 (200,000 rows of image array<float>[784]) goes
through the same SavedModel (784-256-128-10 MLP, ``serving_default``:
image -> classes) by

  (a) Ember's ``ember.ml.EmberModel.transform``: its default direct path
      (the executor JVM packs each row's array into a pipe to an Ember
      inference worker with the model loaded; ember.spark.DirectInference),
      and, for reference, the same model through its Arrow UDF path,
  (b) ``pyspark.ml.functions.predict_batch_udf`` at the best batch size of a
      small sweep,
  (c) TensorFlowOnSpark 2.2.5's ``pipeline.TFModel`` (rdd.mapPartitions, rows
      as Python lists, ``spark.createDataFrame`` of the results),

each materialized completely (``write.format("noop")``) after a warm-up run
(so every Python worker has loaded its model), in --rounds (3) interleaved
rounds, every method once per round, the order rotated from round to round
(bench/rounds.py); each method is reported as its median rows/s and
[min-max] over the rounds, and the headline ratios are ratios of medians.
Each round also times a no-op Arrow UDF over the same column (the
ceiling of Spark's Arrow UDF path: what Spark's row -> Arrow export costs any
method that takes that path, predict_batch_udf and Ember's Arrow UDF path
included), and the CPU seconds of the Spark JVM and its Python workers are
printed per method, median [min-max] too (less sensitive than wall time to
other work on a shared machine).  All three produce the same classes on the
same rows (checked).  Prints a table and

  RESULT inference ember_rps=<x> pbu_rps=<y> tfos_rps=<z> ratio_vs_pbu=<x/y> ratio_vs_tfos=<x/z>
         ember_udf_rps=<Ember's Arrow UDF path> noop_udf_rps=<the no-op UDF> ratio_vs_noop_udf=...
         ember_rps_min=... ember_rps_max=... pbu_rps_min=... pbu_rps_max=...
         tfos_rps_min=... tfos_rps_max=... rounds=<n>

(every *_rps without _min/_max a median).

EMBER_BENCH_QUICK=1 (make bench-smoke) only makes the defaults tiny: the
model trained on 10,000 rows, 1 test set copy (10,000 rows), one
predict_batch_udf batch size (1024: no sweep), 1 timed round (so each
[min-max] is [x-x]); the same methods, checks and code.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

import rounds  # noqa: E402  (bench/rounds.py; bench/ is this script's path)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK = os.environ.get("EMBER_BENCH_QUICK", "") not in ("", "0")
sys.path[:0] = [REPO, os.path.join(REPO, "python")]


def build_saved_model(export_dir: str, train_images: np.ndarray, train_labels: np.ndarray) -> None:
    """The example's model, trained one epoch in this process, exported with the
    example's serving signature (image -> logits, probabilities, classes)."""
    import tensorflow as tf
    import tf_keras as keras

    from examples.fashion_mnist import model as fm

    tf.get_logger().setLevel("ERROR")
    m = fm.build_model()
    m.compile(optimizer=keras.optimizers.Adam(1e-3),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    m.fit(train_images, train_labels, batch_size=128, epochs=1, verbose=0)

    @tf.function(input_signature=[tf.TensorSpec([None, 784], tf.float32, name="image")])
    def serve(image):
        logits = m(image, training=False)
        return {"logits": logits, "probabilities": tf.nn.softmax(logits),
                "classes": tf.argmax(logits, axis=-1)}

    tf.saved_model.save(m, export_dir, signatures={"serving_default": serve})


def _zeros(column):  # the no-op Arrow UDF: one 0 per row
    import pyarrow as pa

    return pa.array(np.zeros(len(column), dtype=np.int64))


def frame(spark, images, labels, copies, parts):
    from examples.fashion_mnist import data

    images = np.tile(images.reshape(-1, 784), (copies, 1))
    labels = np.tile(labels.astype(np.int64), copies)
    chunks = max(1, len(labels) // 10000)  # then spread over the partitions by a shuffle
    return data.to_dataframe(spark, images, labels, chunks).repartition(parts)


def tree_cpu(root: int) -> float:
    """CPU seconds (user + system) used so far by process ``root`` and all its
    descendants, those that exited included (their parents' cutime/cstime)."""
    tick = os.sysconf("SC_CLK_TCK")
    kids: dict = {}
    used: dict = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                text = f.read()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2:].split()
        kids.setdefault(int(fields[1]), []).append(int(d))
        used[int(d)] = sum(int(x) for x in fields[11:15])
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += used.get(pid, 0)
        todo.extend(kids.get(pid, []))
    return total / tick


#: the Spark JVM (driver and executor in local mode; the Python workers are its
#: descendants) whose CPU time timed() reports; set in main()
JVM_PID = 0


def _cpu_now() -> float:
    own = os.times()
    return (tree_cpu(JVM_PID) if JVM_PID else 0.0) + own.user + own.system


def timed(what, build, rows, cpu=None):
    """Runs the query to the noop sink; returns wall seconds.  With ``cpu`` (a
    list), appends the CPU seconds the Spark JVM, its Python workers and this
    driver used meanwhile: on a machine shared with other work, wall time
    varies with their load, CPU time much less."""
    out = build()
    c0 = _cpu_now()
    start = time.perf_counter()
    out.write.format("noop").mode("overwrite").save()
    secs = time.perf_counter() - start
    used = _cpu_now() - c0
    if cpu is not None:
        cpu.append(used)
    print(f"  {what}: {rows} rows in {secs:.2f} s = {rows / secs:,.0f} rows/s "
          f"({used:.1f} CPU s)", flush=True)
    return secs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--copies", type=int, default=1 if QUICK else 20,
                   help="test set copies (default 20: 200,000 rows)")
    p.add_argument("--train-rows", type=int, default=10_000 if QUICK else 60_000,
                   help="training rows for the model (default: all 60,000)")
    p.add_argument("--cores", type=int, default=2, help="local[N] Spark")
    p.add_argument("--sweep", default="1024" if QUICK else "256,1024,4096,10000",
                   help="predict_batch_udf batch sizes")
    p.add_argument("--rounds", type=int, default=1 if QUICK else 3,
                   help="timed interleaved rounds (default 3; 1 with EMBER_BENCH_QUICK=1); "
                        "each method's median [min-max] is reported")
    p.add_argument("--tfos-batch", type=int, default=0,
                   help="TFoS TFModel BatchSize (default: the best predict_batch_udf batch size)")
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be >= 1")

    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    from examples.fashion_mnist import data

    os.environ["PYSPARK_PYTHON"] = sys.executable
    spark = (SparkSession.builder.master(f"local[{args.cores}]").appName("bench-inference")
             .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.ui.enabled", "false").config("spark.driver.memory", "4g")
             .config("spark.sql.shuffle.partitions", str(args.cores))
             .config("spark.executorEnv.PYTHONPATH",
                     os.pathsep.join([REPO, os.path.join(REPO, "bench")]))
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    global JVM_PID
    proc = getattr(spark.sparkContext._gateway, "proc", None)
    JVM_PID = proc.pid if proc is not None else 0
    work = tempfile.mkdtemp(prefix="ember-bench-inference-")
    export = os.path.join(work, "export")
    try:
        tr_x, tr_y = data.load_split("train")
        tr_x, tr_y = tr_x[:args.train_rows], tr_y[:args.train_rows]
        te_x, te_y = data.load_split("test")
        t = time.perf_counter()
        build_saved_model(export, tr_x.reshape(-1, 784).astype(np.float32) / 255.0, tr_y.astype(np.int64))
        print(f"SavedModel trained (1 epoch, {len(tr_y)} rows) and exported in {time.perf_counter() - t:.1f} s", flush=True)

        parts = args.cores * 2
        df = frame(spark, te_x, te_y, args.copies, parts).cache()
        rows = df.count()
        if args.copies == 1:
            small = df  # the same 10,000 rows
        else:
            small = frame(spark, te_x, te_y, 1, parts).cache()
            small.count()
        src, small_src = df.select("image"), small.select("image")
        print(f"{rows} rows x 784 floats cached in {parts} partitions; local[{args.cores}]", flush=True)

        # (a) Ember
        from ember.ml import EmberModel

        ember = (EmberModel().setExportDir(export).setInputMapping({"image": "image"})
                 .setOutputMapping({"classes": "prediction"}))
        ember_out = lambda d: ember.transform(d)  # noqa: E731

        # (b) predict_batch_udf
        from pyspark.ml.functions import predict_batch_udf
        from pyspark.sql.types import LongType

        def make_predict_fn():
            import tensorflow as tf

            fn = tf.saved_model.load(export).signatures["serving_default"]

            def predict(x):
                return fn(image=tf.constant(x))["classes"].numpy()
            return predict

        def pbu_out(d, bs):
            udf = predict_batch_udf(make_predict_fn, return_type=LongType(), batch_size=bs,
                                    input_tensor_shapes=[[784]])
            return d.withColumn("prediction", udf(F.col("image")))

        # (c) TensorFlowOnSpark
        from tensorflowonspark import pipeline as tfos_pipeline

        def tfos_out(d, bs):
            m = (tfos_pipeline.TFModel({"batch_size": bs}).setInputMapping({"image": "image"})
                 .setOutputMapping({"classes": "prediction"}).setExportDir(export)
                 .setSignatureDefKey("serving_default").setTagSet("serve").setBatchSize(bs))
            return m.transform(d)

        print("warm-up and checks (10,000 rows)", flush=True)
        ref = np.array([r[0] for r in ember.transform(small.select("id", "image"))
                        .orderBy("id").select("prediction").collect()])
        got_pbu = np.array([r[0] for r in pbu_out(small.select("id", "image"), 1024)
                            .orderBy("id").select("prediction").collect()])
        got_tfos = np.array([r[0] for r in tfos_out(small.select("image"), 1024).collect()])
        accuracy = float(np.mean(ref == te_y))
        agree_pbu = float(np.mean(ref == got_pbu))
        # TFoS returns predictions only (no id); compare the multisets of classes
        agree_tfos = float(np.array_equal(np.sort(ref), np.sort(got_tfos)))
        print(f"  test accuracy {accuracy:.4f}; predict_batch_udf agrees on {agree_pbu:.4f} of rows; "
              f"TFoS class counts equal: {bool(agree_tfos)}", flush=True)
        if agree_pbu != 1.0 or not agree_tfos:
            raise RuntimeError("the three methods disagree on predictions")
        timed("ember warm-up", lambda: ember_out(small_src), len(te_y))

        # Two interleaved passes, each size keeping its better one (by CPU
        # seconds, which other work on the machine disturbs less than wall
        # time): one pass under a passing load spike picked 256 where 10000
        # is the better size, which made predict_batch_udf look slower.
        sizes = [int(b) for b in args.sweep.split(",")]
        if len(sizes) > 1:
            print(f"predict_batch_udf batch-size sweep ({len(te_y) * 4} rows)", flush=True)
            sweep_src = small_src.unionAll(small_src).unionAll(small_src).unionAll(small_src)
            sweep_cpu: dict = {bs: [] for bs in sizes}
            for _ in range(2):
                for bs in sizes:
                    timed(f"batch_size={bs}", lambda: pbu_out(sweep_src, bs), len(te_y) * 4,
                          sweep_cpu[bs])
            best = min(sizes, key=lambda bs: min(sweep_cpu[bs]))
            print(f"  best batch size: {best}", flush=True)
        else:
            best = sizes[0]  # one size (--sweep N): nothing to choose
            print(f"predict_batch_udf batch size: {best} (no sweep)", flush=True)
        tfos_bs = args.tfos_batch or best
        timed("tfos warm-up", lambda: tfos_out(small_src, tfos_bs), len(te_y))

        # The ceiling of Spark's Arrow UDF path on this machine: an Arrow UDF
        # that does no work (returns zeros) over the same column.  Spark's row
        # -> Arrow export, the socket and the input-row queue cost this much
        # for Ember and predict_batch_udf alike; what a method adds on top is
        # its own (model call, conversions).
        from pyspark.sql.functions import ArrowUDFType, arrow_udf

        zero = arrow_udf(_zeros, LongType(), ArrowUDFType.SCALAR)
        ceiling_out = lambda d: d.withColumn("prediction", zero(F.col("image")))  # noqa: E731

        # Rounds interleave the methods, and each is reported as its median
        # [min-max] over the rounds: the 2 cores are shared with other work,
        # whose load comes and goes.
        ember_udf = (EmberModel().setExportDir(export).setInputMapping({"image": "image"})
                     .setOutputMapping({"classes": "prediction"}).setArrowPath("udf"))
        timed("ember Arrow UDF path warm-up", lambda: ember_udf.transform(small_src), len(te_y))
        # method -> (label, query); round r starts at the r-th (rotated, so
        # that no method always goes first) and goes on in this order
        methods = {
            "noop": ("no-op Arrow UDF (Spark's ceiling)", lambda: ceiling_out(src)),
            "ember": ("ember EmberModel.transform (direct)", lambda: ember_out(src)),
            "ember_udf": ("ember EmberModel.transform (Arrow UDF path)",
                          lambda: ember_udf.transform(src)),
            "pbu": (f"predict_batch_udf (batch_size={best})", lambda: pbu_out(src, best)),
            "tfos": (f"TFoS pipeline.TFModel (BatchSize={tfos_bs})",
                     lambda: tfos_out(src, tfos_bs)),
        }
        cpu: dict = {k: [] for k in methods}
        secs = rounds.interleaved(
            args.rounds,
            {k: functools.partial(timed, what, build, rows, cpu[k])
             for k, (what, build) in methods.items()},
            start=lambda r: print(f"timed round {r + 1}/{args.rounds} ({rows} rows)",
                                  flush=True))

        rps = {k: [rows / s for s in v] for k, v in secs.items()}
        med = {k: rounds.spread(v).median for k, v in rps.items()}
        e_rps = med["ember"]
        print(f"\nmedian [min-max] of {args.rounds} interleaved round"
              f"{'' if args.rounds == 1 else 's'}, {rows} rows, "
              f"local[{args.cores}]; ratios are ratios of medians")
        print(f"{'method':<48}{'median s':>10}{'median rows/s':>15}{'[min-max] rows/s':>22}"
              f"{'ember vs it':>13}")
        for k, name in (("ember", "ember EmberModel.transform (direct)"),
                        ("ember_udf", "ember EmberModel.transform (Arrow UDF)"),
                        ("pbu", f"predict_batch_udf (batch_size={best})"),
                        ("tfos", f"TFoS 2.2.5 pipeline.TFModel (BatchSize={tfos_bs})"),
                        ("noop", "no-op Arrow UDF (the Arrow UDF path ceiling)")):
            print(f"{name:<48}{rounds.spread(secs[k]).median:>10.2f}{med[k]:>15,.0f}"
                  f"{rounds.fmt_range(rps[k], ',.0f'):>22}{e_rps / med[k]:>12.2f}x")
        names = {"ember": "ember", "ember_udf": "ember Arrow UDF path", "pbu": "predict_batch_udf",
                 "tfos": "tfos", "noop": "no-op Arrow UDF"}
        cpu_med = {k: rounds.spread(v).median for k, v in cpu.items()}
        print("CPU seconds (Spark JVM + Python workers + driver), median [min-max] of the "
              "rounds: " +
              ", ".join(f"{names[k]} {rounds.fmt_spread(cpu[k], '.1f')}"
                        for k in ("ember", "ember_udf", "pbu", "tfos", "noop")) +
              f"; predict_batch_udf / ember {cpu_med['pbu'] / cpu_med['ember']:.2f}x")
        print(f"RESULT inference ember_rps={e_rps:.0f} pbu_rps={med['pbu']:.0f} "
              f"tfos_rps={med['tfos']:.0f} "
              f"ratio_vs_pbu={e_rps / med['pbu']:.2f} ratio_vs_tfos={e_rps / med['tfos']:.2f} "
              f"ember_udf_rps={med['ember_udf']:.0f} noop_udf_rps={med['noop']:.0f} "
              f"ratio_vs_noop_udf={e_rps / med['noop']:.2f} "
              + " ".join(f"{k}_rps_min={min(rps[k]):.0f} {k}_rps_max={max(rps[k]):.0f}"
                         for k in ("ember", "pbu", "tfos"))
              + f" rounds={args.rounds}", flush=True)
        return 0
    finally:
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
