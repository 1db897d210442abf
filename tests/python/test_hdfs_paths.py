"""hdfs:// paths through Ember's Python API, against the mini HDFS: ember.hdfs
(rename, upload/download, Mirror, glob, default_fs/qualify), ember.tfrecord
(write/reader/list_files/inspect/detect_compression, and Spark save/load),
ctx.absolute_path, and Spark ML inference on models in HDFS (EmberModel's
ExportDir, TFModel's checkpoint ModelDir, the per-host model cache).
Everything goes through libember's WebHDFS client."""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest
from hadoop_fixture import HadoopCluster

from ember import _ember, hdfs
from ember import tfrecord as tfr
from ember.node import NodeContext

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def hconf(hadoop_cluster: HadoopCluster, monkeypatch: pytest.MonkeyPatch) -> HadoopCluster:
    monkeypatch.setenv("HADOOP_CONF_DIR", hadoop_cluster.conf_dir)
    monkeypatch.setenv("HADOOP_USER_NAME", hadoop_cluster.user)
    return hadoop_cluster


def _url(c: HadoopCluster, name: str) -> str:
    return c.hdfs_url(f"/test-paths/{name}-{uuid.uuid4().hex[:8]}")


def test_rename_is_atomic_and_never_moves_into(hconf: HadoopCluster) -> None:
    base = _url(hconf, "rename")
    hdfs.write_bytes(base + "/a", b"first")
    hdfs.makedirs(base + "/dir")
    # rename2 semantics: an existing directory is not entered, the call fails
    with pytest.raises(_ember.EmberError, match="must both be directories"):
        hdfs.rename(base + "/a", base + "/dir")
    assert hdfs.listdir(base + "/dir") == []
    hdfs.rename(base + "/a", base + "/b")
    assert hdfs.listdir(base) == ["b", "dir"]
    hdfs.write_bytes(base + "/c", b"second")
    with pytest.raises(_ember.EmberError, match="already exists"):
        hdfs.rename(base + "/c", base + "/b")
    hdfs.rename(base + "/c", base + "/b", overwrite=True)
    assert hdfs.read_bytes(base + "/b") == b"second"
    with pytest.raises(FileNotFoundError, match="RENAME"):
        hdfs.rename(base + "/nope", base + "/x")
    with pytest.raises(FileNotFoundError):
        hdfs.rename(base + "/b", base + "/no/parent/x")
    # the destination may be a URL of the same file system
    hdfs.rename(base + "/b", base + "/d")
    assert hdfs.isfile(base + "/d") and not hdfs.exists(base + "/b")


def test_upload_download_and_mirror(hconf: HadoopCluster, tmp_path) -> None:
    src = tmp_path / "model"
    (src / "variables").mkdir(parents=True)
    (src / "saved_model.pb").write_bytes(os.urandom(3 << 20))  # 3 blocks of 1 MiB
    (src / "variables" / "variables.index").write_bytes(b"idx")
    (src / "empty").write_bytes(b"")
    url = _url(hconf, "upload")
    hdfs.upload(str(src), url)
    assert hdfs.listdir(url) == ["empty", "saved_model.pb", "variables"]
    assert not [n for n in hdfs.listdir(os.path.dirname(url)) if "_COPYING_" in n]
    back = hdfs.download(url, str(tmp_path / "back"))
    for rel in ("saved_model.pb", "variables/variables.index", "empty"):
        assert open(os.path.join(back, rel), "rb").read() == (src / rel).read_bytes()
    # a second upload replaces the tree
    (src / "saved_model.pb").write_bytes(b"v2")
    hdfs.upload(str(src), url)
    assert hdfs.read_bytes(url + "/saved_model.pb") == b"v2"
    with pytest.raises(FileExistsError):
        hdfs.upload(str(src), url, overwrite=False)
    # Mirror: downloads what is there, syncs, uploads on exit
    with hdfs.Mirror(url) as m:
        assert open(os.path.join(m.local, "saved_model.pb"), "rb").read() == b"v2"
        with open(os.path.join(m.local, "checkpoint"), "w") as f:
            f.write("step 1")
        m.sync()
        assert hdfs.read_bytes(url + "/checkpoint") == b"step 1"
        with open(os.path.join(m.local, "checkpoint"), "w") as f:
            f.write("step 2")
        local = m.local
    assert hdfs.read_bytes(url + "/checkpoint") == b"step 2"
    assert not os.path.exists(local)
    with pytest.raises(FileNotFoundError):
        hdfs.download(url + "/missing", str(tmp_path / "x"))


def test_default_fs_qualify_and_absolute_path(hconf: HadoopCluster, tmp_path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    assert hdfs.default_fs() == hconf.fs
    assert hdfs.qualify("/data/x") == hconf.fs + "/data/x"
    assert hdfs.qualify("data/x") == f"{hconf.fs}/user/{hconf.user}/data/x"
    assert hdfs.qualify("file:///tmp/y") == "file:///tmp/y"
    ctx = NodeContext(executor_id=0, worker_num=0, job_name="chief", task_index=0,
                      cluster_spec={}, num_workers=1, host="127.0.0.1", ports=[],
                      input_mode=1, working_dir=str(tmp_path))
    assert ctx.absolute_path("/data/x") == hconf.fs + "/data/x"
    assert ctx.absolute_path("model") == f"{hconf.fs}/user/{hconf.user}/model"
    assert ctx.absolute_path("hdfs://other:8020/z") == "hdfs://other:8020/z"
    monkeypatch.delenv("HADOOP_CONF_DIR")
    assert hdfs.default_fs() == "file://"
    assert ctx.absolute_path("model") == "file://" + str(tmp_path / "model")


def test_tfrecord_write_reader_inspect_over_hdfs(hconf: HadoopCluster) -> None:
    base = _url(hconf, "tfr")
    n = 5000
    x = np.random.default_rng(1).random((n, 16), dtype=np.float32)
    y = np.arange(n, dtype=np.int64)
    assert tfr.write(base + "/part-00000.tfrecord.gz", {"x": x[:3000], "y": y[:3000]},
                     compression="gzip") == 3000
    assert tfr.write(base + "/part-00001.tfrecord.gz", {"x": x[3000:], "y": y[3000:]},
                     compression="gzip") == 2000
    hdfs.write_bytes(base + "/_SUCCESS", b"")
    # no temporary files left beside the parts
    assert hdfs.listdir(base) == ["_SUCCESS", "part-00000.tfrecord.gz", "part-00001.tfrecord.gz"]
    files = tfr.list_files(base)
    assert files == [base + "/part-00000.tfrecord.gz", base + "/part-00001.tfrecord.gz"]
    assert tfr.list_files(base + "/part-*.gz") == files
    assert tfr.detect_compression(files[0]) == 1
    got_x, got_y = [], []
    for b in tfr.reader(base, 700, {"x": ("float32", 16), "y": "int64"}):
        got_x.append(b["x"])
        got_y.append(b["y"])
    np.testing.assert_array_equal(np.concatenate(got_y), y)
    np.testing.assert_array_equal(np.concatenate(got_x), x)
    # sharded like two workers
    shard = [b["y"] for b in tfr.reader(base, 1000, ["y"], shard=(1, 2))]
    np.testing.assert_array_equal(np.concatenate(shard), y[3000:])
    info = tfr.inspect(files[1], records=1)
    assert info["records"] == 2000 and info["error"] is None
    assert info["first"][0]["y"] == [3000]
    with pytest.raises(FileNotFoundError, match="no TFRecord files"):
        tfr.list_files(base + "/nothing-*")
    with pytest.raises(FileNotFoundError, match="missing.tfrecord"):
        tfr.open_reader(base + "/missing.tfrecord", compression=None)


def test_tfrecord_permission_denied_names_path_and_user(hconf: HadoopCluster,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import urllib.parse
    import urllib.request

    base = _url(hconf, "perm")
    tfr.write(base + "/private.tfrecord", {"y": np.arange(3)})
    q = urllib.parse.urlencode({"op": "SETPERMISSION", "permission": "700",
                                "user.name": hconf.user})
    path = base[len(hconf.fs):]
    req = urllib.request.Request(f"{hconf.webhdfs}/webhdfs/v1{path}?{q}", method="PUT")
    urllib.request.urlopen(req, timeout=30).close()
    monkeypatch.setenv("HADOOP_USER_NAME", "mallory")
    with pytest.raises(PermissionError, match="mallory") as ei:
        list(tfr.reader(base + "/private.tfrecord", 10, ["y"]))
    assert isinstance(ei.value, hdfs.EmberPermissionError) and "private.tfrecord" in str(ei.value)
    with pytest.raises(PermissionError, match="other.tfrecord.*mallory|mallory.*other.tfrecord"):
        tfr.write(base + "/other.tfrecord", {"y": np.arange(3)})


def test_tfrecord_save_load_hdfs_with_spark(hconf: HadoopCluster, local_spark) -> None:
    spark = local_spark
    url = _url(hconf, "spark-save")
    df = spark.range(0, 1000, 1, numPartitions=3).selectExpr(
        "id", "cast(id * 0.5 as float) as half", "array(id, id + 1) as pair",
        "concat('row-', cast(id as string)) as name")
    assert tfr.save(df, url) == 1000
    names = hdfs.listdir(url)
    assert names == ["_SUCCESS", "part-00000.tfrecord", "part-00001.tfrecord",
                     "part-00002.tfrecord"]
    with pytest.raises(FileExistsError):
        tfr.save(df, url)
    back = tfr.load(spark, url).orderBy("id").collect()
    assert len(back) == 1000
    assert back[7]["half"] == 3.5 and list(back[7]["pair"]) == [7, 8]
    assert back[7]["name"] == "row-7"
    assert tfr.save(df.limit(10), url, mode="overwrite", compression="gzip") == 10
    assert [n for n in hdfs.listdir(url) if n.startswith("part-")] \
        and all(n.endswith(".gz") for n in hdfs.listdir(url) if n.startswith("part-"))


# --------------------------------------------------------------------------- models on HDFS

def _tiny_savedmodel(tf, scale: float) -> object:
    """y = x @ [1, 2] * scale for x float32 [None, 2]: one tf.function, so
    tf.saved_model.save makes it the serving_default signature (x -> y)."""

    class Tiny(tf.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = tf.Variable(np.array([[1.0], [2.0]], np.float32) * scale)

        @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.float32, name="x")])
        def serve(self, x):
            return {"y": tf.matmul(x, self.w)[:, 0]}

    return Tiny()


def _xy_frame(spark, n: int = 40):
    x = np.arange(2 * n, dtype=np.float32).reshape(n, 2) / 10.0
    df = spark.createDataFrame([(i, x[i].tolist()) for i in range(n)],
                               "id long, x array<float>").coalesce(1)
    return df, x


def _ys(df) -> np.ndarray:
    return np.array([r["y"] for r in sorted(df.collect(), key=lambda r: r["id"])])


def _forget_cached(url: str) -> None:
    """Removes this host's cached copies of ``url`` (the test's own model)."""
    import shutil

    from ember.ml import _model_files

    shutil.rmtree(_model_files.cache_dir(url), ignore_errors=True)


def test_ember_model_with_hdfs_export_dir(local_spark, hconf: HadoopCluster, tmp_path) -> None:
    """EmberModel reads a SavedModel from hdfs:// as from a local directory (the
    executors find the NameNode through the driver's HADOOP_CONF_DIR), from one
    cached copy per version; a model rewritten on HDFS is picked up, a missing
    one and an unreachable NameNode are named."""
    tf = pytest.importorskip("tensorflow")
    from ember.compat.tfos import compat
    from ember.errors import EmberError
    from ember.ml import EmberEstimator, EmberModel, ModelInputError, _model_files

    url = _url(hconf, "export")
    local = str(tmp_path / "export")
    compat.export_saved_model(_tiny_savedmodel(tf, 1.0), local, is_chief=True)
    hdfs.upload(local, url)
    df, x = _xy_frame(local_spark)

    def model(path: str) -> EmberModel:
        return EmberModel().setExportDir(path).setInputMapping({"x": "x"}) \
            .setOutputMapping({"y": "y"})

    try:
        want = x @ np.array([1.0, 2.0], np.float32)
        # a Python worker (mapInArrow), as for the local directory, and the
        # direct path's worker process
        from_hdfs = _ys(model(url).setArrowPath("mapInArrow").transform(df))
        np.testing.assert_allclose(from_hdfs, want, rtol=1e-6)
        np.testing.assert_array_equal(
            _ys(model(local).setArrowPath("mapInArrow").transform(df)), from_hdfs)
        np.testing.assert_array_equal(_ys(model(url).transform(df)), from_hdfs)
        base = _model_files.cache_dir(url)
        assert len(os.listdir(base)) == 1  # one version, copied once for the whole host
        # fit()'s model of an hdfs:// export: the signature's inputs, read there
        made = (EmberEstimator(lambda args, ctx: None).setExportDir(url)
                .setInputMapping({"x": "x", "label": "label"}))._make_model({})
        assert isinstance(made, EmberModel) and made.getInputMapping() == {"x": "x"}

        # the estimator side: TFoS's export call uploads to an hdfs:// export dir
        compat.export_saved_model(_tiny_savedmodel(tf, 3.0), url, is_chief=True)
        np.testing.assert_allclose(_ys(model(url).setArrowPath("mapInArrow").transform(df)),
                                   3 * want, rtol=1e-6)
        assert len(os.listdir(base)) == 2  # the first is kept while it may be in use
        assert not [n for n in os.listdir(base) if n.startswith(".tmp")]

        with pytest.raises(ModelInputError, match=f"ExportDir '{url}-missing' holds no "
                                                  "SavedModel"):
            model(url + "-missing").transform(df)
        with pytest.raises(EmberError, match=r"ExportDir 'webhdfs://127.0.0.1:1/m': cannot "
                                             r"read it from HDFS \(set HADOOP_CONF_DIR"):
            model("webhdfs://127.0.0.1:1/m").transform(df)
    finally:
        _forget_cached(url)


def test_concurrent_copies_of_one_model(hconf: HadoopCluster, tmp_path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Python workers of one host copying the same model at once (threads here,
    started together; the copies run in C without the GIL): each downloads to
    its own temporary directory, one rename wins, everybody uses that copy."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from ember.ml import _model_files

    monkeypatch.setenv("EMBER_MODEL_CACHE", str(tmp_path / "cache"))
    url = _url(hconf, "race")
    src = tmp_path / "model"
    (src / "variables").mkdir(parents=True)
    (src / "saved_model.pb").write_bytes(b"pb")
    data = src / "variables" / "variables.data-00000-of-00001"
    data.write_bytes(os.urandom(4 << 20))
    hdfs.upload(str(src), url)
    start = threading.Barrier(4)

    def load(_: int):
        start.wait()
        return _model_files.saved_model(url)

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(load, range(4)))
    assert len({p for p, _ in got}) == 1 and len({s for _, s in got}) == 1
    path = got[0][0]
    with open(os.path.join(path, "variables", data.name), "rb") as f:
        assert f.read() == data.read_bytes()
    assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]  # no temp dir left


def test_tfmodel_with_hdfs_model_dir_checkpoint(local_spark, hconf: HadoopCluster,
                                                tmp_path) -> None:
    """TensorFlowOnSpark's TFModel on a TF1 checkpoint in an hdfs:// ModelDir
    (its 'checkpoint' file names the prefix by the absolute local path the
    Saver wrote); a newer checkpoint uploaded there is picked up."""
    tf = pytest.importorskip("tensorflow")
    from ember.compat.tfos.pipeline import TFModel
    from ember.ml import ModelInputError

    url = _url(hconf, "ckpt")

    def checkpoint(scale: float, step: int) -> None:
        g = tf.Graph()
        with g.as_default():
            x = tf.compat.v1.placeholder(tf.float32, [None, 2], name="x")
            w = tf.compat.v1.get_variable(
                "w", initializer=tf.constant(np.array([[1.0], [2.0]], np.float32) * scale))
            tf.identity(tf.matmul(x, w)[:, 0], name="y")
            with tf.compat.v1.Session(graph=g) as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                tf.compat.v1.train.Saver().save(sess, str(tmp_path / "ckpt" / "model"),
                                                global_step=step)
        hdfs.upload(str(tmp_path / "ckpt"), url)

    checkpoint(1.0, 3)
    assert str(tmp_path) in hdfs.read_bytes(url + "/checkpoint").decode()  # an absolute path
    df, x = _xy_frame(local_spark)
    model = TFModel().setModelDir(url).setInputMapping({"x": "x"}).setOutputMapping({"y": "y"}) \
        .setArrowPath("mapInArrow")
    want = x @ np.array([1.0, 2.0], np.float32)
    try:
        np.testing.assert_allclose(_ys(model.transform(df)), want, rtol=1e-6)
        checkpoint(2.0, 4)
        np.testing.assert_allclose(_ys(model.transform(df)), 2 * want, rtol=1e-6)
        with pytest.raises(ModelInputError, match=f"ModelDir '{url}-none' holds no checkpoint"):
            model.setModelDir(url + "-none").transform(df)
    finally:
        _forget_cached(url)


def test_parameter_server_checkpoints_on_hdfs(hconf: HadoopCluster) -> None:
    """ParameterServers(checkpoint_dir="hdfs://...") (ember.ps): a shard's
    checkpoint goes up whole (uploaded under a temporary name, renamed) and
    new servers restore the values and the optimizer state from it."""
    from ember import ps

    url = _url(hconf, "ps-ckpt")
    secret = os.urandom(32)

    def shards() -> list:
        return [_ember.PsServer(secret, k, 2, 1, host="127.0.0.1") for k in range(2)]

    def client(servers: list) -> _ember.PsClient:
        c = _ember.PsClient(["127.0.0.1"] * 2, [s.port for s in servers], secret, 0, 1,
                            timeout_s=30.0)
        c.declare("w", "dense", 6, 4, "adam", 0.01, init="uniform", init_scale=0.1, seed=3)
        return c

    grads = np.linspace(-1, 1, 24, dtype=np.float32).reshape(6, 4)
    servers = shards()
    c = client(servers)
    assert not ps.restore_checkpoint(servers[0], 0, 2, url)  # none yet
    c.push("w", None, grads)
    for k, s in enumerate(servers):
        ps.save_checkpoint(s, k, 2, url)
    c.push("w", None, grads)
    expected = c.pull("w", None, 4)
    c.close()
    for s in servers:
        s.close()
    assert sorted(hdfs.listdir(url)) == ["ps-0-of-2.ckpt", "ps-1-of-2.ckpt"]

    servers = shards()
    for k, s in enumerate(servers):
        assert ps.restore_checkpoint(s, k, 2, url)
    c = client(servers)
    c.push("w", None, grads)  # the same second step, from the restored Adam state
    np.testing.assert_array_equal(c.pull("w", None, 4), expected)
    c.close()
    for s in servers:
        s.close()
