"""The main job and Spark ML inference on Spark on a Kerberized YARN, run as
its own process by tests/python/test_kerberos.py (a YARN driver cannot share
the test session's local Spark; this one's Hadoop is the Kerberized grid).

    HADOOP_CONF_DIR=... KRB5_CONFIG=... KRB5CCNAME=... python kerberos_job.py \\
        --out result.json --conf spark.k=v ... -- <main job arguments>

In one Spark application:

1. the main job (examples/fashion_mnist/main.py's steps) with ``--data-dir``
   on HDFS in InputMode.TENSORFLOW: the executors write the CSV and
   TFRecords, the nodes read the TFRecords, and the inference's feeding
   tasks read the CSV, all with the HDFS delegation tokens Spark hands the
   executors' containers (InputMode.SPARK would read HDFS only as those
   feeding tasks do, so it is left to the suite's other main-job runs);
2. TensorFlowOnSpark's ``dfutil.saveAsTFRecords`` / ``loadTFRecords`` on HDFS;
3. the TENSORFLOW run's SavedModel uploaded to HDFS and scored by
   ``EmberModel`` and TFoS's ``TFModel`` with that ``hdfs://`` ExportDir: the
   executors copy it from HDFS with their tokens.

The result (accuracies, counts) goes to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict

import numpy as np


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--conf", action="append", default=[])
    a, job_argv = p.parse_known_args()
    job_argv = [x for x in job_argv if x != "--"]

    from pyspark.sql import SparkSession

    from examples.fashion_mnist import data, main as job
    from ember import hdfs

    args = job.parse_args(job_argv)
    args.work_dir = os.path.abspath(args.work_dir)
    args.intra_op_threads = args.inter_op_threads = 1
    b = (SparkSession.builder.master("yarn").appName("ember-kerberos")
         .config("spark.driver.host", "127.0.0.1")
         .config("spark.driver.bindAddress", "127.0.0.1")
         .config("spark.ui.enabled", "false"))
    for kv in a.conf:
        k, _, v = kv.partition("=")
        b = b.config(k, v)
    spark = b.getOrCreate()
    sc = spark.sparkContext
    sc.setLogLevel("WARN")
    result: Dict[str, Any] = {"app_id": sc.applicationId}
    try:
        n_train, n_test = job.setup_data(spark, args)
        accuracy, rate, _ = job.train_and_evaluate(spark, args, "tensorflow", n_train, n_test)
        result["tensorflow"] = {"accuracy": accuracy, "records_per_s": rate}

        # TensorFlowOnSpark's dfutil on HDFS
        from ember.compat.tfos import dfutil

        images, labels = data.load_split("test")
        images, labels = images[:n_test], labels[:n_test]
        test_df = data.to_dataframe(spark, images, labels, 2).select("image", "label")
        tfr = args.data_dir + "/dfutil"
        result["dfutil_saved"] = dfutil.saveAsTFRecords(test_df, tfr)
        back = dfutil.loadTFRecords(sc, tfr)
        result["dfutil_loaded"] = back.count()
        result["dfutil_labels_equal"] = sorted(
            int(np.asarray(r["label"]).reshape(-1)[0]) for r in back.collect()) == \
            sorted(int(v) for v in labels)

        # the TENSORFLOW run's SavedModel on HDFS, scored by the Spark ML stages
        from ember.compat.tfos.pipeline import TFModel
        from ember.ml import EmberModel

        export = args.data_dir + "/export"
        hdfs.delete(export, recursive=True)
        hdfs.upload(os.path.join(args.work_dir, "tensorflow", "export"), export)
        for name, stage in (("ember_model", EmberModel()),
                            ("tfmodel", TFModel().setSignatureDefKey("serving_default"))):
            stage = stage.setExportDir(export).setInputMapping({"image": "image"}) \
                .setOutputMapping({"classes": "prediction"})
            rows = stage.transform(test_df).select("label", "prediction").collect()
            result[name] = {"rows": len(rows), "accuracy": float(np.mean(
                [int(r["label"]) == int(np.asarray(r["prediction"]).reshape(-1)[0])
                 for r in rows]))}
    finally:
        spark.stop()
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    print("RESULT kerberos " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
