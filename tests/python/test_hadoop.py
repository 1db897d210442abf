"""The test Hadoop itself: HDFS through WebHDFS, YARN through the RM REST API,
and the client configuration it writes.  Plain urllib, no Ember code: these
tests say the fixture works, so the HDFS tests of Ember's own reader can
trust it."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
import xml.etree.ElementTree as ET
from typing import Any, Dict, Optional

import pytest
from hadoop_fixture import HadoopCluster

pytestmark = pytest.mark.timeout(300)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # WebHDFS's two-step writes: the caller follows the 307


_opener = urllib.request.build_opener(_NoRedirect)


def webhdfs(cluster: HadoopCluster, method: str, path: str, op: str,
            data: Optional[bytes] = None, **params: Any) -> Any:
    """One WebHDFS call as cluster.user; follows the DataNode redirect."""
    q = urllib.parse.urlencode({"op": op, "user.name": cluster.user, **params})
    url = f"{cluster.webhdfs}/webhdfs/v1{path}?{q}"
    req = urllib.request.Request(url, method=method)
    try:
        resp = _opener.open(req, timeout=60)
    except urllib.error.HTTPError as e:
        if e.code != 307:
            raise
        location = e.headers["Location"]
        e.close()
        req = urllib.request.Request(location, data=data, method=method)
        resp = urllib.request.urlopen(req, timeout=60)
    with resp:
        return resp.status, resp.read()


def conf_props(path: str) -> Dict[str, str]:
    root = ET.parse(path).getroot()
    return {p.findtext("name"): p.findtext("value") for p in root.iter("property")}


def test_webhdfs_round_trip(hadoop_cluster: HadoopCluster) -> None:
    payload = os.urandom(3 * 1024 * 1024 + 12345)  # spans 4 blocks of 1 MiB
    status, _ = webhdfs(hadoop_cluster, "PUT", "/tmp/fixture/roundtrip.bin", "CREATE",
                        data=payload, overwrite="true")
    assert status == 201
    status, body = webhdfs(hadoop_cluster, "GET", "/tmp/fixture/roundtrip.bin",
                           "GETFILESTATUS")
    st = json.loads(body)["FileStatus"]
    assert st["length"] == len(payload)
    assert st["blockSize"] == 1024 * 1024
    status, body = webhdfs(hadoop_cluster, "GET", "/tmp/fixture/roundtrip.bin", "OPEN")
    assert status == 200 and body == payload
    # a ranged read, as Ember's reader does
    status, body = webhdfs(hadoop_cluster, "GET", "/tmp/fixture/roundtrip.bin", "OPEN",
                           offset=1024 * 1024 - 7, length=100)
    assert body == payload[1024 * 1024 - 7:1024 * 1024 + 93]


def test_yarn_has_one_active_node_manager(hadoop_cluster: HadoopCluster) -> None:
    with urllib.request.urlopen(f"{hadoop_cluster.rm_web}/ws/v1/cluster/metrics",
                                timeout=30) as r:
        metrics = json.load(r)["clusterMetrics"]
    assert metrics["activeNodes"] == 1
    assert metrics["unhealthyNodes"] == 0
    assert metrics["totalMB"] > 0
    with urllib.request.urlopen(f"{hadoop_cluster.rm_web}/ws/v1/cluster/nodes",
                                timeout=30) as r:
        nodes = json.load(r)["nodes"]["node"]
    assert [n["state"] for n in nodes] == ["RUNNING"]
    with urllib.request.urlopen(f"{hadoop_cluster.rm_web}/ws/v1/cluster/scheduler",
                                timeout=30) as r:
        sched = json.load(r)["scheduler"]["schedulerInfo"]
    assert [q["queueName"] for q in sched["queues"]["queue"]] == ["default"]


def test_client_configuration(hadoop_cluster: HadoopCluster) -> None:
    conf = hadoop_cluster.conf_dir
    assert sorted(os.listdir(conf)) == ["core-site.xml", "hdfs-site.xml", "yarn-site.xml"]
    core = conf_props(os.path.join(conf, "core-site.xml"))
    assert core["fs.defaultFS"] == hadoop_cluster.fs
    hdfs = conf_props(os.path.join(conf, "hdfs-site.xml"))
    assert "http://" + hdfs["dfs.namenode.http-address"] == hadoop_cluster.webhdfs
    yarn = conf_props(os.path.join(conf, "yarn-site.xml"))
    assert yarn["yarn.resourcemanager.address"] == hadoop_cluster.rm
    assert "http://" + yarn["yarn.resourcemanager.webapp.address"] == hadoop_cluster.rm_web
    for key, value in yarn.items():
        if key.startswith("yarn.resourcemanager.") and key.endswith(".address"):
            assert value.startswith("127.0.0.1:"), (key, value)
    assert hadoop_cluster.env()["HADOOP_CONF_DIR"] == conf
    assert "HADOOP_CONF_DIR" not in os.environ or os.environ["HADOOP_CONF_DIR"] != conf


# ---------------------------------------------------------------------------
# libember's WebHDFS client (csrc/webhdfs.c) against the real mini HDFS


def _ember() -> Any:
    from ember import _ember
    return _ember


def test_c_reader_reads_a_multi_block_file(hadoop_cluster: HadoopCluster) -> None:
    E = _ember()
    payload = os.urandom(2 * 1024 * 1024 + 777)  # 3 blocks of 1 MiB
    webhdfs(hadoop_cluster, "PUT", "/tmp/c/blocks.bin", "CREATE", data=payload,
            overwrite="true")
    url = hadoop_cluster.hdfs_url("/tmp/c/blocks.bin")
    # hdfs:// resolved through the conf dir's hdfs-site.xml
    assert E.hdfs_read(url, conf_dir=hadoop_cluster.conf_dir) == payload
    assert E.hdfs_read(url, 1024 * 1024 - 5, 10, conf_dir=hadoop_cluster.conf_dir) == \
        payload[1024 * 1024 - 5:1024 * 1024 + 5]
    # ranges of 300 KiB: ranges straddle block boundaries
    with E.HdfsFile(url, conf_dir=hadoop_cluster.conf_dir, range_bytes=300 * 1024) as f:
        assert f.size == len(payload)
        parts = []
        while True:
            b = f.read(100_000)
            if not b:
                break
            parts.append(b)
        assert b"".join(parts) == payload
        st = f.stats
        assert st["ranges"] == -(-len(payload) // (300 * 1024))
        assert st["bytes"] == len(payload) and st["retries"] == 0
        assert f.seek(-10, 2) == len(payload) - 10
        buf = bytearray(64)
        assert f.readinto(buf) == 10 and bytes(buf[:10]) == payload[-10:]
    assert f.closed
    # the webhdfs:// form names the HTTP address directly
    web = hadoop_cluster.webhdfs.replace("http://", "webhdfs://") + "/tmp/c/blocks.bin"
    assert E.hdfs_read(web, 0, 100) == payload[:100]


def test_c_reader_uses_hadoop_conf_dir(hadoop_cluster: HadoopCluster,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    E = _ember()
    webhdfs(hadoop_cluster, "PUT", "/tmp/c/conf.txt", "CREATE", data=b"via conf",
            overwrite="true")
    monkeypatch.setenv("HADOOP_CONF_DIR", hadoop_cluster.conf_dir)
    assert E.hdfs_read("hdfs:///tmp/c/conf.txt") == b"via conf"  # fs.defaultFS
    assert E.hdfs_read(hadoop_cluster.hdfs_url("/tmp/c/conf.txt")) == b"via conf"


def test_c_writer_list_and_delete(hadoop_cluster: HadoopCluster) -> None:
    E = _ember()
    conf = {"conf_dir": hadoop_cluster.conf_dir}
    d = hadoop_cluster.hdfs_url("/tmp/c/out")
    E.hdfs_delete(d, recursive=True, **conf)
    parts = {f"part-{i:05d}": os.urandom(1000 * (i + 1)) for i in range(3)}
    for name, data in parts.items():
        E.hdfs_write(f"{d}/{name}", data, **conf)  # one CREATE each
    E.hdfs_write(f"{d}/_SUCCESS", b"", **conf)
    # a file bigger than the chunk: CREATE then APPENDs, on the real DataNode
    big = os.urandom(700_000)
    E.hdfs_write(f"{d}/big.bin", big, range_bytes=256 * 1024, **conf)
    listing = E.hdfs_list(d, **conf)
    assert [e["name"] for e in listing] == ["_SUCCESS", "big.bin", *parts]
    by_name = {e["name"]: e for e in listing}
    for name, data in parts.items():
        assert by_name[name]["length"] == len(data) and by_name[name]["type"] == "FILE"
        # read back independently of Ember
        assert webhdfs(hadoop_cluster, "GET", f"/tmp/c/out/{name}", "OPEN")[1] == data
    assert by_name["big.bin"]["length"] == len(big)
    assert E.hdfs_read(f"{d}/big.bin", **conf) == big
    assert by_name["_SUCCESS"]["length"] == 0
    assert by_name["big.bin"]["owner"] == hadoop_cluster.user
    st = E.hdfs_stat(d, **conf)
    assert st["type"] == "DIRECTORY"
    with pytest.raises(E.EmberError, match="already exists"):
        E.hdfs_write(f"{d}/part-00000", b"x", overwrite=False, **conf)
    E.hdfs_mkdirs(hadoop_cluster.hdfs_url("/tmp/c/out/sub/deeper"), **conf)
    assert E.hdfs_stat(hadoop_cluster.hdfs_url("/tmp/c/out/sub/deeper"), **conf)["type"] \
        == "DIRECTORY"
    assert E.hdfs_delete(d, recursive=True, **conf) is True
    assert E.hdfs_delete(d, recursive=True, **conf) is False


def test_c_reader_missing_file_and_permission(hadoop_cluster: HadoopCluster) -> None:
    E = _ember()
    conf = {"conf_dir": hadoop_cluster.conf_dir}
    missing = hadoop_cluster.hdfs_url("/tmp/c/no/such/file.tfrecord")
    with pytest.raises(FileNotFoundError) as ei:
        E.hdfs_read(missing, **conf)
    assert isinstance(ei.value, E.EmberFileNotFoundError)
    assert "/tmp/c/no/such/file.tfrecord" in str(ei.value)
    assert ei.value.name == "EMBER_ENOTFOUND"
    with pytest.raises(E.EmberFileNotFoundError):
        E.HdfsFile(missing, **conf)

    # a directory only its owner may enter
    webhdfs(hadoop_cluster, "PUT", "/tmp/c/private/secret.bin", "CREATE", data=b"s3cret",
            overwrite="true")
    webhdfs(hadoop_cluster, "PUT", "/tmp/c/private", "SETPERMISSION", permission="700")
    url = hadoop_cluster.hdfs_url("/tmp/c/private/secret.bin")
    assert E.hdfs_read(url, **conf) == b"s3cret"  # the owner
    with pytest.raises(PermissionError) as ei:
        E.hdfs_read(url, user="mallory", **conf)
    assert isinstance(ei.value, E.EmberPermissionError)
    msg = str(ei.value)
    assert "/tmp/c/private/secret.bin" in msg and "mallory" in msg
    assert "AccessControlException" in msg
    with pytest.raises(E.EmberPermissionError):
        E.hdfs_write(hadoop_cluster.hdfs_url("/tmp/c/private/new"), b"x", user="mallory",
                     **conf)
    # a directory is not a file
    with pytest.raises(E.EmberError, match="is a directory"):
        E.hdfs_read(hadoop_cluster.hdfs_url("/tmp/c/private"), **conf)
