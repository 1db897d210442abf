"""ember.ml with PyTorch (EmberTorchModel, TorchScript) on a local Spark: a
Fashion-MNIST Pipeline whose Estimator trains with DDP on 2 nodes and exports
TorchScript (10,000 test rows, accuracy with Spark's evaluator, save/load with
identical predictions), mappings by argument name and position, dict/tuple/
tensor outputs and their column types, bad input named on the driver.
"""

from __future__ import annotations

import argparse
from typing import Dict, Tuple

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (requirements.txt pins it)")

import ml_torchfuns  # noqa: E402
from ml_fashion import check_fitted_pipeline, fashion_frame, fashion_pipeline  # noqa: E402
from ember.ml import (EmberEstimator, EmberTorchModel, ModelInputError, TorchModel,  # noqa: E402
                      save_torchscript)



# --------------------------------------------------------------------------- pipeline

def test_fashion_mnist_torch_pipeline_fit_transform_save_load(local_spark, tmp_path):
    spark = local_spark
    train = fashion_frame(spark, "train", parts=4).cache()
    test = fashion_frame(spark, "test", parts=2).cache()
    assert train.count() == 60000 and test.count() == 10000
    args = argparse.Namespace(learning_rate=1e-3, seed=1, threads=1, strategy="ddp-ember")
    pipeline = fashion_pipeline(EmberEstimator(ml_torchfuns.train_fn, args), 3, str(tmp_path))
    fitted = pipeline.fit(train)
    model = fitted.stages[1]
    # fit() returns the torch Model of what train_fn exported; the label is no
    # argument of forward(), so it is left out of the model's inputs
    assert isinstance(model, EmberTorchModel)
    assert model.getInputMapping() == {"image": "image"}
    assert model.getExportDir() == str(tmp_path / "export")

    again, loaded_est = check_fitted_pipeline(fitted, pipeline, test, str(tmp_path), "torch")
    assert isinstance(again.stages[1], EmberTorchModel)
    assert again.stages[1].tf_args.strategy == "ddp-ember"
    assert isinstance(loaded_est, EmberEstimator)
    assert loaded_est.train_fn is ml_torchfuns.train_fn
    assert loaded_est.getEpochs() == 3 and loaded_est.getClusterSize() == 2
    train.unpersist()
    test.unpersist()


# --------------------------------------------------------------------------- small modules

W = np.arange(8, dtype=np.float32).reshape(4, 2) / 10.0


class DictOut(torch.nn.Module):
    """forward(x float [n, 4], n int [n], scale=2.0) -> {"y": x @ W, "s": sum(x) * scale
    (float64), "k": n * 3}"""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.from_numpy(W.copy()))

    def forward(self, x: torch.Tensor, n: torch.Tensor, scale: float = 2.0) -> Dict[str, torch.Tensor]:
        x.mul_(1.0)  # in place on its input: must not touch the DataFrame's column
        return {"y": x @ self.w, "s": x.sum(dim=1).double() * scale, "k": n * 3}


class TupleOut(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.from_numpy(W.copy()))

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        y = x @ self.w
        return y, y.argmax(dim=1).to(torch.int32)


class Image(torch.nn.Module):
    """forward(img float [n, 1, 2, 2]) -> a tensor [n] (sum of pixels)."""

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        assert img.dim() == 4, "img must be [n, 1, 2, 2]"
        return img.sum(dim=(1, 2, 3))


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    root = tmp_path_factory.mktemp("torch_models")
    paths = {"dict": str(root / "dict.pt"), "tuple": str(root / "tuple")}
    torch.jit.save(torch.jit.script(DictOut()), paths["dict"])  # a plain torch.jit.save file
    save_torchscript(TupleOut(), paths["tuple"], method="trace",
                     example_inputs=(torch.zeros(3, 4),))
    paths["image"] = str(root / "image")
    save_torchscript(Image(), paths["image"], example_inputs={"img": torch.zeros(1, 1, 2, 2)})
    return paths


def _small_frame(spark, n=400, parts=3):
    rng = np.random.default_rng(3)
    x = rng.random((n, 4), dtype=np.float32)
    rows = [(i, [float(v) for v in x[i]], i) for i in range(n)]
    # feats: array<double> (the module is float32: cast), cnt: int (to int64)
    df = spark.createDataFrame(rows, "id long, feats array<double>, cnt int").repartition(parts)
    return df, x.astype(np.float64).astype(np.float32)


def test_torchscript_export_dir_on_hdfs(local_spark, hadoop_cluster, monkeypatch, tmp_path):
    """save_torchscript to an hdfs:// ExportDir (written locally, uploaded), the
    Estimator's model of it, and EmberTorchModel reading it there (the
    executors copy the archive once per version; they find the NameNode through
    the driver's HADOOP_CONF_DIR)."""
    import shutil
    import uuid

    from ember.ml import _model_files

    monkeypatch.setenv("HADOOP_CONF_DIR", hadoop_cluster.conf_dir)
    monkeypatch.setenv("HADOOP_USER_NAME", hadoop_cluster.user)
    url = hadoop_cluster.hdfs_url(f"/test-ml-torch/export-{uuid.uuid4().hex[:8]}")
    archive = save_torchscript(TupleOut(), url, method="trace",
                               example_inputs=(torch.zeros(3, 4),))
    assert archive == url + "/model.pt"
    made = (EmberEstimator(ml_torchfuns.train_fn, {}).setExportDir(url)
            .setInputMapping({"feats": "x", "label": "label"}))._make_model({})
    assert isinstance(made, EmberTorchModel) and made.getInputMapping() == {"feats": "x"}
    df, x = _small_frame(local_spark, n=100, parts=1)
    try:
        for path in (url, archive):  # the directory, or the archive itself
            m = (TorchModel().setExportDir(path).setInputMapping({"feats": "x"})
                 .setOutputMapping({"0": "y"}).setArrowPath("mapInArrow"))
            rows = sorted(m.transform(df).collect(), key=lambda r: r["id"])
            ids = np.array([r["id"] for r in rows])
            np.testing.assert_allclose(np.array([r["y"] for r in rows]), x[ids] @ W, rtol=1e-5)
        with pytest.raises(ModelInputError, match=f"ExportDir '{url}-none' holds no TorchScript"):
            m.setExportDir(url + "-none").transform(df)
    finally:  # this host's copy of the test's archive
        shutil.rmtree(_model_files.cache_dir(archive), ignore_errors=True)


@pytest.mark.parametrize("path", ["udf", "mapInArrow"])
def test_dict_outputs_by_name_and_position(local_spark, modules, path):
    df, x = _small_frame(local_spark)
    # "0" is forward()'s first argument (x), "n" the second by name
    m = (TorchModel().setExportDir(modules["dict"]).setInputMapping({"feats": "0", "cnt": "n"})
         .setOutputMapping({"y": "y", "s": "s", "k": "k"}).setBatchSize(64).setArrowPath(path))
    out = m.transform(df)
    plan = out._jdf.queryExecution().executedPlan().toString()
    assert ("ArrowEvalPython" if path == "udf" else "MapInArrow") in plan, plan
    types = {f.name: f.dataType.simpleString() for f in out.schema.fields}
    assert types == {"id": "bigint", "feats": "array<double>", "cnt": "int",
                     "y": "array<float>", "s": "double", "k": "bigint"}
    rows = sorted(out.collect(), key=lambda r: r["id"])
    assert len(rows) == 400
    ids = np.array([r["id"] for r in rows])
    np.testing.assert_allclose(np.array([r["y"] for r in rows]), x[ids] @ W, rtol=1e-5)
    np.testing.assert_allclose(np.array([r["s"] for r in rows]), x[ids].sum(axis=1) * 2.0,
                               rtol=1e-5)
    assert [r["k"] for r in rows] == (ids * 3).tolist()
    # the in-place mul_ on the input did not reach the passed-through column
    np.testing.assert_allclose(np.array([r["feats"] for r in rows]), x[ids], rtol=1e-6)


def test_tuple_outputs_declared_shapes_and_persistence(local_spark, modules, tmp_path):
    from pyspark.sql import functions as F

    df, x = _small_frame(local_spark, n=200, parts=2)
    m = (EmberTorchModel().setExportDir(modules["tuple"]).setInputMapping({"feats": "x"})
         .setOutputMapping({"0": "y", "1": "arg"}))
    out = m.transform(df)
    types = {f.name: f.dataType.simpleString() for f in out.schema.fields}
    assert types["y"] == "array<float>" and types["arg"] == "int"
    rows = sorted(out.collect(), key=lambda r: r["id"])
    ids = np.array([r["id"] for r in rows])
    np.testing.assert_allclose(np.array([r["y"] for r in rows]), x[ids] @ W, rtol=1e-5)
    assert [r["arg"] for r in rows] == (x[ids] @ W).argmax(axis=1).tolist()

    # a flat array<float>[4] column reshaped to the declared [n, 1, 2, 2]
    img = (EmberTorchModel().setExportDir(modules["image"])
           .setInputMapping({"pix": "img"}).setOutputMapping({"0": "total"}))
    pix = df.select("id", F.col("feats").cast("array<float>").alias("pix"))
    got = {r["id"]: r["total"] for r in img.transform(pix).collect()}
    assert got[7] == pytest.approx(float(x[7].sum()), rel=1e-5)

    m.write().overwrite().save(str(tmp_path / "tm"))
    back = EmberTorchModel.load(str(tmp_path / "tm"))
    assert isinstance(back, EmberTorchModel) and back.uid == m.uid
    assert back.getOutputMapping() == {"0": "y", "1": "arg"}
    again = sorted(back.transform(df).collect(), key=lambda r: r["id"])
    assert [r["y"] for r in again] == [r["y"] for r in rows]


@pytest.mark.parametrize("model, case, message, job", [
    ("dict", "missing", r"InputMapping column\(s\) \['feats'\] not in the DataFrame", False),
    ("dict", "string", r"column 'feats' has type array<string>; model input '0' .* needs numbers",
     False),
    ("dict", "unknown_arg", r"model input 'q' is not an argument of forward\(x: Tensor, "
     r"n: Tensor, scale: float=\.\.\.\)", False),
    ("dict", "unbound", r"needs argument\(s\) \['n'\] that no InputMapping column maps to", False),
    ("dict", "not_tensor", r"argument 'scale' of forward\(.*\) is float, not a Tensor", False),
    # a wrong row length: the dry run on the first row names column and error
    ("dict", "length", r"dry run of .*dict.pt on the DataFrame's first row failed: "
     r"forward\(x=float32\[1, 3\] from column 'feats', n=int64\[1\] from column 'cnt'\): "
     r".*mat1 and mat2 shapes cannot be multiplied \(1x3 and 4x2\)", True),
    ("dict", "output", r"forward\(\) of .* has no output\(s\) \['z'\] \(outputs: "
     r"\['k', 's', 'y'\]", True),
    # declared inputs: checked statically (no dry-run row needed)
    ("tuple", "declared_rank", r"column 'feats' holds one number per row \(double\); "
     r"model input 'x' \(float32 \[None, 4\]\) takes arrays", False),
    ("tuple", "declared_length", r"column 'feats' has arrays of 3 values; model input 'x' "
     r"\(float32 \[None, 4\]\) takes 4 per row", True),
    ("dict", "no_export", r"ExportDir '.*nowhere' holds no TorchScript archive", False),
])
def test_bad_input_is_named_before_any_task(local_spark, modules, tmp_path, model, case,
                                            message, job):
    spark = local_spark
    mapping = {"feats": "0", "cnt": "n"} if model == "dict" else {"feats": "x"}
    m = (EmberTorchModel().setExportDir(modules[model]).setInputMapping(mapping)
         .setOutputMapping({"y": "y"} if model == "dict" else {"0": "y"}))
    frames = {
        "missing": "SELECT 1L AS id, 2 AS cnt",
        "string": "SELECT array('a','b','c','d') AS feats, 1 AS cnt",
        "length": "SELECT array(1.0D, 2.0D, 3.0D) AS feats, 1 AS cnt",
        "declared_rank": "SELECT 1.0D AS feats",
        "declared_length": "SELECT array(1.0D, 2.0D, 3.0D) AS feats",
    }
    df = spark.sql(frames.get(case, "SELECT array(1.0D, 2.0D, 3.0D, 4.0D) AS feats, 1 AS cnt"))
    if case == "unknown_arg":
        m.setInputMapping({"feats": "0", "cnt": "q"})
    if case == "unbound":
        m.setInputMapping({"feats": "x"})
    if case == "not_tensor":
        m.setInputMapping({"feats": "x", "cnt": "n", "id": "scale"})
        df = spark.sql("SELECT array(1.0D, 2.0D, 3.0D, 4.0D) AS feats, 1 AS cnt, 2.0D AS id")
    if case == "output":
        m.setOutputMapping({"z": "z"})
    if case == "no_export":
        m.setExportDir(str(tmp_path / "nowhere"))
    tracker = spark.sparkContext.statusTracker()
    before = tracker.getJobIdsForGroup(None)
    with pytest.raises(ModelInputError, match=message):
        m.transform(df)
    # at most the one-row job of a dry run or a length check; no inference task
    if not job:
        assert tracker.getJobIdsForGroup(None) == before


def test_streaming_needs_declared_inputs(local_spark, modules, tmp_path):
    spark = local_spark
    df, x = _small_frame(spark, n=300, parts=3)
    src, sink, ckpt = (str(tmp_path / d) for d in ("in", "out", "ckpt"))
    df.write.parquet(src)
    stream = spark.readStream.schema(df.schema).option("maxFilesPerTrigger", 1).parquet(src)
    # a module saved with example inputs types its outputs without reading a row
    m = (EmberTorchModel().setExportDir(modules["tuple"]).setInputMapping({"feats": "x"})
         .setOutputMapping({"0": "y"}))
    query = (m.transform(stream).writeStream.format("parquet").option("checkpointLocation", ckpt)
             .trigger(availableNow=True).start(sink))
    query.awaitTermination(180)
    assert query.exception() is None
    rows = sorted(spark.read.parquet(sink).collect(), key=lambda r: r["id"])
    assert len(rows) == 300
    ids = np.array([r["id"] for r in rows])
    np.testing.assert_allclose(np.array([r["y"] for r in rows]), x[ids] @ W, rtol=1e-5)
    # a plain torch.jit.save file declares nothing: a streaming DataFrame has no row
    # for the dry run, and the error says what to do
    plain = (EmberTorchModel().setExportDir(modules["dict"])
             .setInputMapping({"feats": "x", "cnt": "n"}).setOutputMapping({"y": "y"}))
    with pytest.raises(ModelInputError, match=r"declares no input shapes.*save_torchscript"):
        plain.transform(stream)
