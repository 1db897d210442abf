"""hdfs:// paths through Ember's Python API, against the mini HDFS: ember.hdfs
(rename, upload/download, Mirror, glob, default_fs/qualify), ember.tfrecord
(write/reader/list_files/inspect/detect_compression, and Spark save/load),
ctx.absolute_path.  Everything goes through libember's WebHDFS client."""

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
