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
