"""The Fashion-MNIST pipeline of the ember.ml tests (TensorFlow: test_ml.py,
PyTorch: test_ml_torch.py): its DataFrames, SQL stages and the checks both
runs must pass.  It imports neither TensorFlow nor PyTorch."""

from __future__ import annotations

from typing import Any, Dict, Tuple

import numpy as np

SCALE_SQL = "SELECT id, transform(pixels, p -> CAST(p / 255.0 AS FLOAT)) AS image, label FROM __THIS__"
# Spark's evaluators want a double prediction; the model's classes are int64
CAST_SQL = "SELECT *, CAST(class AS DOUBLE) AS prediction FROM __THIS__"


def fashion_frame(spark: Any, split: str, limit: int = 0, parts: int = 4) -> Any:
    """Fashion-MNIST as a DataFrame: id long, pixels array<float> (raw 0..255), label long."""
    from examples.fashion_mnist import data

    images, labels = data.load_split(split)
    if limit:
        images, labels = images[:limit], labels[:limit]
    # one chunk per partition: equal partitions, so the nodes get equal shares
    return data.to_dataframe(spark, images, labels, parts, scaled=False)


def fashion_pipeline(est: Any, epochs: int, path: str) -> Any:
    """[scale pixels to image, est on 2 nodes, cast class to prediction]: est
    (an EmberEstimator) maps image and label in and classes/probabilities out,
    with its model and export directories under path."""
    from pyspark.ml import Pipeline
    from pyspark.ml.feature import SQLTransformer

    est = (est.setInputMapping({"image": "image", "label": "label"})
           .setOutputMapping({"classes": "class", "probabilities": "probability"})
           .setClusterSize(2).setEpochs(epochs).setBatchSize(64).setReservationTimeout(120)
           .setModelDir(f"{path}/model").setExportDir(f"{path}/export"))
    return Pipeline(stages=[SQLTransformer(statement=SCALE_SQL), est,
                            SQLTransformer(statement=CAST_SQL)])


Predictions = Dict[int, Tuple[float, Any]]


def _predictions(out: Any) -> Predictions:
    return {r["id"]: (r["prediction"], r["probability"])
            for r in out.select("id", "prediction", "probability").collect()}


def check_fitted_pipeline(fitted: Any, pipeline: Any, test: Any, path: str,
                          what: str) -> Tuple[Any, Any]:
    """Transforms the 10,000 test rows with the fitted [scale, model, cast]
    pipeline: output types, accuracy >= 0.85 by Spark's evaluator, one model
    load per Python worker; then saves and reloads the PipelineModel (identical
    predictions) and the Pipeline.  Returns (reloaded PipelineModel, reloaded
    Estimator) for the caller's own checks."""
    from pyspark.ml import Pipeline, PipelineModel
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator

    from ember.ml import _runtime

    out = fitted.transform(test).cache()  # scored once, for the evaluator and the checks
    types = {f.name: f.dataType.simpleString() for f in out.schema.fields}
    assert types["class"] == "bigint" and types["probability"] == "array<float>"
    accuracy = MulticlassClassificationEvaluator(
        labelCol="label", predictionCol="prediction", metricName="accuracy").evaluate(out)
    print(f"Fashion-MNIST {what} pipeline accuracy: {accuracy:.4f}")
    assert accuracy >= 0.85
    first = _predictions(out)
    assert len(first) == 10000
    probs = np.array([p for _, p in first.values()])
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=1e-4)

    # each Python worker loaded the model once, whatever number of tasks it ran
    loads = test.repartition(6).mapInArrow(_runtime.worker_loads, "pid long, loads long").collect()
    assert loads and all(r["loads"] <= 1 for r in loads), loads

    fitted.write().overwrite().save(f"{path}/pipeline_model")
    pipeline.write().overwrite().save(f"{path}/pipeline")
    again = PipelineModel.load(f"{path}/pipeline_model")
    assert _predictions(again.transform(test)) == first
    return again, Pipeline.load(f"{path}/pipeline").getStages()[1]
