"""``run_on_yarn``: tf-yarn's launcher on Ember (the client side, pure Python).

The 10-line version::

    from ember.yarn import run_on_yarn, TaskSpec

    def experiment_fn():
        def task(ctx):                      # or a KerasExperiment / PytorchExperiment
            total = ctx.allreduce(np.array([ctx.collective.rank], np.float64))
            return {"role": ctx.job_name, "sum_of_ranks": float(total[0])}
        return task

    metrics = run_on_yarn(experiment_fn, {"chief": TaskSpec("1 GiB", 1),
                                          "worker": TaskSpec("1 GiB", 1, instances=2)})
    metrics["worker:1"].metrics                 # {"role": "worker", "sum_of_ranks": 3.0}

What happens: the client stages on HDFS (``/user/<user>/.ember/<name>-<id>``,
a 0700 directory) the cloudpickled ``experiment_fn``, Ember's
ApplicationMaster jar, its Hadoop configuration, the user's ``files``, the
packed Python environment if any, and per attempt a task plan (JSON) and a
fresh 32-byte secret (a 0600 file).  It starts Ember's reservation server (C,
authenticated: every connection proves the secret) and submits the
application through the ResourceManager's REST API.  The AM starts
``python -m ember.yarn.task`` in one container per task; YARN localizes the
secret into each container as a private file (it never appears in a command
line or an environment variable), and each task registers with the client,
gets its role, the cluster spec and ``TF_CONFIG``, runs the experiment and
reports DONE with its metrics, or FAILED with its traceback.  A failed
application is submitted again (a new attempt: ``EMBER_YARN_ATTEMPT``, a new
secret) up to ``nb_retries`` times; ``model_dir`` checkpoints make training
resume.  When every attempt failed, :class:`RunFailed` names the failing task
and carries its traceback and the tail of its container logs.
"""

from __future__ import annotations

import io
import json
import logging
import mmap
import os
import re
import shutil
import socket
import sys
import time
import urllib.parse
import uuid
import zipfile
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

from ember import _ember, _jars, _log, hdfs
from ember.yarn import _rest, _tracking
from ember.yarn._rest import GridAuth
from ember.yarn._specs import (Metrics, RunFailed, TaskResult, TaskSpec, parse_memory,
                               validate)
from ember.yarn._topology import EXPERIMENT_FILE, HEARTBEAT_TIMEOUT_S, RDV_ORDER, role_of

#: Java 17 closes JDK internals that Hadoop reaches into (as Spark's list;
#: tests/python/hadoop_fixture.py passes the same to the mini clusters)
JAVA17_OPENS = [
    f"--add-opens=java.base/{pkg}=ALL-UNNAMED"
    for pkg in ("java.lang", "java.lang.invoke", "java.lang.reflect", "java.io", "java.net",
                "java.nio", "java.util", "java.util.concurrent",
                "java.util.concurrent.atomic", "sun.nio.ch", "sun.nio.cs",
                "sun.security.action", "sun.util.calendar")
]
#: YarnConfiguration.DEFAULT_YARN_CROSS_PLATFORM_APPLICATION_CLASSPATH
_DEFAULT_APP_CLASSPATH = [
    "{{HADOOP_CONF_DIR}}",
    "{{HADOOP_COMMON_HOME}}/share/hadoop/common/*",
    "{{HADOOP_COMMON_HOME}}/share/hadoop/common/lib/*",
    "{{HADOOP_HDFS_HOME}}/share/hadoop/hdfs/*",
    "{{HADOOP_HDFS_HOME}}/share/hadoop/hdfs/lib/*",
    "{{HADOOP_YARN_HOME}}/share/hadoop/yarn/*",
    "{{HADOOP_YARN_HOME}}/share/hadoop/yarn/lib/*",
]
_AM_JAR = "ember-yarn-am.jar"
_PLAN = "ember-plan.json"
_SECRET = "ember.secret"
_CONF = "ember_conf"  # the client's Hadoop configuration, unpacked in every container


logger = logging.getLogger("ember.yarn")


class _ResourceManager:
    """The ResourceManager REST API (``/ws/v1/cluster``), authenticated as the
    grid asks (:class:`ember.yarn._rest.GridAuth`)."""

    def __init__(self, web: str, auth: GridAuth) -> None:
        self.web = web.rstrip("/")
        self.auth = auth
        self.user = auth.user

    def _call(self, method: str, path: str, body: Any = None,
              accept: str = "application/json") -> bytes:
        return _rest.http(method, f"{self.web}/ws/v1/cluster{path}", body, accept=accept,
                          auth=self.auth)[1]

    def new_application(self) -> Dict[str, Any]:
        return json.loads(self._call("POST", "/apps/new-application"))

    def submit(self, context: Dict[str, Any]) -> None:
        self._call("POST", "/apps", context)

    def app(self, app_id: str) -> Dict[str, Any]:
        return json.loads(self._call("GET", f"/apps/{app_id}"))["app"]

    def kill(self, app_id: str) -> None:
        self._call("PUT", f"/apps/{app_id}/state", {"state": "KILLED"})

    def am_log_tail(self, app_id: str, nbytes: int = 4096) -> str:
        """The tail of the AM's stderr (best effort: the NodeManager may have
        aggregated and removed it already)."""
        try:
            attempts = json.loads(self._call("GET", f"/apps/{app_id}/appattempts"))
            last = attempts["appAttempts"]["appAttempt"][-1]
            url = (f"http://{last['nodeHttpAddress']}/ws/v1/node/containerlogs/"
                   f"{last['containerId']}/AppMaster.stderr?size={-nbytes}")
            text = _rest.http("GET", url, accept="text/plain", auth=self.auth)[1]
            return text.decode(errors="replace")[-nbytes:]
        except Exception as e:  # logs gone, or no attempt started
            return f"(AppMaster.stderr not available: {e})"


# --------------------------------------------------------------------------- staging

def _private_dir(conf_dir: str, url: str) -> None:
    """The directory url, created with mode 0700 (the staging directory holds
    the job's secret)."""
    _ember.hdfs_mkdirs(url, conf_dir=conf_dir)
    _ember.hdfs_set_permission(url, 0o700, conf_dir=conf_dir)


class _Stager:
    """Puts files in the staging dir and describes them as YARN local resources."""

    def __init__(self, root: str, conf_dir: str) -> None:
        self.root = root
        self.conf_dir = conf_dir

    def resource(self, name: str, url: str, kind: str = "FILE") -> Dict[str, Any]:
        st = _ember.hdfs_stat(url, conf_dir=self.conf_dir)
        # YARN checks size and modification time at localization: a file
        # changed after submission fails the container instead of running
        # something else
        return {"name": name, "uri": url, "size": int(st["length"]),
                "timestamp": int(st["modification_time"]), "type": kind}

    def put_bytes(self, rel: str, data: bytes) -> str:
        url = f"{self.root}/{rel}"
        _ember.hdfs_write(url, data, overwrite=True, conf_dir=self.conf_dir)
        return url

    def put_file(self, rel: str, local: str) -> str:
        url = f"{self.root}/{rel}"
        with open(local, "rb") as f:
            if os.path.getsize(local) == 0:
                _ember.hdfs_write(url, b"", overwrite=True, conf_dir=self.conf_dir)
            else:
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                    _ember.hdfs_write(url, m, overwrite=True, conf_dir=self.conf_dir)
        return url


def _zip_dir(path: str, only: Optional[List[str]] = None) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for base, _, names in os.walk(path):
            for n in sorted(names):
                full = os.path.join(base, n)
                rel = os.path.relpath(full, path)
                if only is None or rel in only:
                    z.write(full, rel)
    return buf.getvalue()


def _archive_kind(path: str) -> str:
    low = path.lower()
    if low.endswith((".tar.gz", ".tgz", ".tar", ".zip", ".jar")):
        return "ARCHIVE"
    if low.endswith(".pex"):
        return "FILE"
    raise ValueError(f"pyenv_zip_path {path!r}: expected a packed environment "
                     "(.tar.gz/.tgz/.tar/.zip from venv-pack or conda-pack) or a .pex file")


def _dumps_experiment(experiment_fn: Callable[[], Any]) -> bytes:
    from ember._imports import cloudpickle

    return cloudpickle().dumps(experiment_fn)


def _java_home() -> Optional[str]:
    home = os.environ.get("JAVA_HOME")
    java = shutil.which("java")
    if not home and java:
        home = os.path.dirname(os.path.dirname(os.path.realpath(java)))
    return home


def _am_jar() -> str:
    """The ApplicationMaster jar: package data of the installed wheel, or
    ``$EMBER_YARN_AM_JAR``."""
    jar = os.environ.get("EMBER_YARN_AM_JAR") or _jars.YARN_AM_JAR
    if not os.path.isfile(jar):
        raise RuntimeError(f"Ember's ApplicationMaster jar is missing ({jar}): this Ember "
                           "was installed without its jars (reinstall it, or `make build` "
                           "in a checkout), or point EMBER_YARN_AM_JAR at one")
    return jar


def _client_host(rm_web: str) -> str:
    """The address the containers reach this client at: the one this host
    uses towards the ResourceManager (EMBER_YARN_CLIENT_HOST overrides)."""
    if os.environ.get("EMBER_YARN_CLIENT_HOST"):
        return os.environ["EMBER_YARN_CLIENT_HOST"]
    host = urllib.parse.urlparse(rm_web).hostname or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))
            return s.getsockname()[0]
        except OSError:
            return socket.gethostname()


# --------------------------------------------------------------------------- run

def run_on_yarn(experiment_fn: Callable[[], Any], task_specs: Mapping[str, TaskSpec], *,
                env: Optional[Mapping[str, str]] = None,
                files: Optional[Mapping[str, str]] = None, queue: str = "default",
                name: str = "RunOnYarn", nb_retries: int = 0,
                pyenv_zip_path: Optional[str] = None,
                custom_task_module: Optional[str] = None, python: Optional[str] = None,
                conf_dir: Optional[str] = None, timeout: float = 3600.0,
                am_memory: Union[int, str] = "512 MiB") -> Metrics:
    """Runs ``experiment_fn``'s experiment on YARN containers, one per task
    (tf-yarn's ``run_on_yarn``; see the module docstring).

    Args:
        experiment_fn: called in every task (after the rendezvous), returns a
            ``KerasExperiment``/``PytorchExperiment`` (:mod:`ember.yarn.experiment`)
            or a plain callable ``f(ctx) -> dict | None``; cloudpickled.
        task_specs: task type -> :class:`TaskSpec`; types ``chief``,
            ``worker``, ``ps``, ``evaluator``, ``tensorboard``.
        env: extra environment of every task.
        files: container file name -> local path (a directory is zipped and
            unpacked under that name) or ``hdfs://`` URL, localized into every
            task's working directory.
        queue, name: the YARN queue and application name.
        nb_retries: how many times a failed application is submitted again.
        pyenv_zip_path: a packed environment (venv-pack/conda-pack
            ``.tar.gz``/``.zip``, local or ``hdfs://``; its ``bin/python`` is
            used) or a ``.pex``; default: ``python``.
        custom_task_module: a module run with ``python -m`` instead of
            ``ember.yarn.task`` (it calls :func:`ember.yarn.task.run_node`).
        python: the interpreter in the containers (default: this one,
            ``sys.executable``, which suits a grid whose hosts share it).
        conf_dir: the Hadoop configuration (default ``$HADOOP_CONF_DIR``).
        timeout: seconds one attempt may take before it is killed.
        am_memory: the ApplicationMaster's container.

    With ``MLFLOW_TRACKING_URI`` set, the call is one MLflow run (as tf-yarn's):
    its arguments and task specs as params, per attempt the application id,
    per task the container time, host and exit status, the failing task's
    traceback and log tails as artifacts; the tasks get the run id, so a
    chief's ``ctx.log_metrics`` logs into it (:mod:`ember.yarn._tracking`).

    Progress (attempts, the tasks' reports and failures) is logged to the
    ``ember.yarn`` logger; when the application configured no logging, Ember
    logs to stderr at INFO (see :mod:`ember._log`).

    Returns:
        :class:`Metrics` of the successful attempt.

    Raises:
        ValueError: bad ``task_specs`` or arguments (before anything is submitted).
        RunFailed: every attempt failed.
    """
    _log.default_handler()
    topo = validate(task_specs)
    if not callable(experiment_fn):
        raise ValueError(f"experiment_fn must be callable, not {type(experiment_fn).__name__}")
    if not isinstance(nb_retries, int) or nb_retries < 0:
        raise ValueError(f"nb_retries must be an int >= 0, got {nb_retries!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    d = conf_dir or os.environ.get("HADOOP_CONF_DIR")
    if not d or not os.path.isfile(os.path.join(d, "yarn-site.xml")):
        raise ValueError(f"no Hadoop configuration: conf_dir / HADOOP_CONF_DIR is {d!r} "
                         "(a directory with core-site.xml, hdfs-site.xml and yarn-site.xml)")
    conf_dir = d
    fs = hdfs.default_fs(conf_dir)
    if not fs.startswith("hdfs://"):
        raise ValueError(f"fs.defaultFS of {conf_dir} is {fs!r}: run_on_yarn stages its files "
                         "on HDFS")
    from ember.yarn._check import _rm_web

    rm_web = _rm_web(conf_dir)
    if not rm_web:
        raise ValueError(f"{conf_dir}/yarn-site.xml has no yarn.resourcemanager.webapp.address "
                         "or yarn.resourcemanager.hostname")
    auth = GridAuth(conf_dir)  # on a Kerberized grid: needs a ticket or keytab now
    user = auth.user
    rm = _ResourceManager(rm_web, auth)
    files = dict(files or {})
    for fname in files:
        if not fname or "/" in fname or fname in (_SECRET, _PLAN, _AM_JAR, _CONF, "pyenv",
                                                  EXPERIMENT_FILE):
            raise ValueError(f"files: {fname!r} is not a usable container file name")
    for what, src in [*((f"files[{k!r}]", v) for k, v in files.items()),
                      ("pyenv_zip_path", pyenv_zip_path or "")]:
        if src and not hdfs.is_hdfs(src) and not os.path.exists(src):
            raise ValueError(f"{what}: {src!r} does not exist")
    pyenv_kind = _archive_kind(pyenv_zip_path) if pyenv_zip_path else ""
    am_mb = parse_memory(am_memory)
    pickled = _dumps_experiment(experiment_fn)

    t0 = time.monotonic()
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:64]
    staging = f"{fs.rstrip('/')}/user/{user}/.ember/{safe}-{uuid.uuid4().hex[:12]}"
    stager = _Stager(staging, conf_dir)
    _private_dir(conf_dir, staging)
    app_ids: List[str] = []
    failures: List[str] = []
    last: Optional[RunFailed] = None
    # MLFLOW_TRACKING_URI set: one MLflow run for the call, handed to every task
    tracking = _tracking.start(name, task_specs, queue, nb_retries, timeout, pyenv_zip_path,
                               custom_task_module, user)
    env = dict(env or {}, **(tracking.node_env() if tracking is not None else {}))
    try:
        logger.info(f"staging in {staging}")
        shared = [
            stager.resource(EXPERIMENT_FILE,
                            stager.put_bytes(EXPERIMENT_FILE, pickled)),
            stager.resource(_CONF, stager.put_bytes(
                "ember-conf.zip", _zip_dir(conf_dir, ["core-site.xml", "hdfs-site.xml",
                                                      "yarn-site.xml"])), "ARCHIVE"),
        ]
        for fname, src in sorted(files.items()):
            if hdfs.is_hdfs(src):
                shared.append(stager.resource(fname, src))
            elif os.path.isdir(src):
                shared.append(stager.resource(
                    fname, stager.put_bytes(f"files/{fname}.zip", _zip_dir(src)), "ARCHIVE"))
            else:
                shared.append(stager.resource(fname, stager.put_file(f"files/{fname}", src)))
        py = python or sys.executable
        if pyenv_zip_path:
            # the name keeps its extension: YARN picks how to unpack by it
            url = pyenv_zip_path if hdfs.is_hdfs(pyenv_zip_path) else stager.put_file(
                "pyenv-" + os.path.basename(pyenv_zip_path), pyenv_zip_path)
            link = "pyenv.pex" if pyenv_kind == "FILE" else "pyenv"
            shared.append(stager.resource(link, url, pyenv_kind))
            py = python or ("./pyenv.pex" if pyenv_kind == "FILE" else "./pyenv/bin/python")
        am_jar = stager.resource(_AM_JAR, stager.put_file(_AM_JAR, _am_jar()))

        for attempt in range(1, nb_retries + 2):
            result, failure = _attempt(
                rm, stager, shared, am_jar, attempt, task_specs, topo, user, env,
                f"{py} -m {custom_task_module or 'ember.yarn.task'}", queue, name, timeout,
                am_mb, app_ids, rm_web)
            if len(app_ids) == attempt:
                _tracking.attempt_submitted(tracking, attempt, app_ids[-1])
            if result is not None:
                result.wall_s = time.monotonic() - t0
                result.app_ids = list(app_ids)
                logger.info(f"{name}: succeeded ({app_ids[-1]}, attempt {attempt}, "
                            f"{result.wall_s:.1f} s)")
                _tracking.attempt_succeeded(tracking, attempt, result)
                if tracking is not None:
                    tracking.end("FINISHED")
                return result
            assert failure is not None
            _tracking.attempt_failed(tracking, attempt, failure)
            failures.append(str(failure))
            last = failure
            more = attempt <= nb_retries
            logger.warning(f"{name}: attempt {attempt} ({app_ids[-1] if app_ids else '-'}) "
                           f"failed: {str(failure).splitlines()[0]}"
                           + ("; retrying" if more else ""))
    except BaseException:
        if tracking is not None:
            tracking.end("KILLED")  # interrupted, or the ResourceManager stopped answering
        raise
    finally:
        try:
            _ember.hdfs_delete(staging, True, conf_dir=conf_dir)
        except Exception as e:  # never mask the outcome
            logger.warning(f"could not remove {staging}: {e} (remove it by hand)")
    assert last is not None
    attempts = nb_retries + 1
    if tracking is not None:
        tracking.end("FAILED")
    raise RunFailed(f"{name}: all {attempts} attempt(s) failed ({', '.join(app_ids)}); "
                    f"the last: {last}", last.task, app_ids, last.traceback, last.logs, failures)


def _attempt(rm: _ResourceManager, stager: _Stager, shared: List[Dict[str, Any]],
             am_jar: Dict[str, Any], attempt: int, task_specs: Mapping[str, TaskSpec],
             topo: Dict[str, int], user: str, user_env: Mapping[str, str], command: str,
             queue: str, name: str, timeout: float, am_mb: int, app_ids: List[str],
             rm_web: str) -> Tuple[Optional[Metrics], Optional[RunFailed]]:
    """One application: a fresh secret and rendezvous; (Metrics, None) on
    success, (None, RunFailed) on failure."""
    secret = _ember.random_secret()
    nodes = sum(topo[r] for r in RDV_ORDER)
    server = _ember.RendezvousServer(secret, nodes, num_ps=topo["ps"],
                                     chief=topo["chief"] > 0, evaluator=topo["evaluator"] > 0,
                                     heartbeat_timeout_ms=int(HEARTBEAT_TIMEOUT_S * 1000))
    try:
        adir = f"attempt-{attempt}"
        secret_url = stager.put_bytes(f"{adir}/{_SECRET}", secret)
        _ember.hdfs_set_permission(secret_url, 0o600, conf_dir=stager.conf_dir)
        env = {k: str(v) for k, v in user_env.items()}  # ours below win
        env.update({
            "EMBER_YARN_RDV": f"{_client_host(rm_web)}:{server.port}",
            "EMBER_YARN_SECRET_FILE": _SECRET,
            "EMBER_YARN_TOPOLOGY": ",".join(f"{k}={v}" for k, v in topo.items()),
            "EMBER_YARN_ATTEMPT": str(attempt),
            "EMBER_YARN_STAGING": f"{stager.root}/{adir}",
            "EMBER_YARN_RDV_TIMEOUT": str(int(min(timeout, 900))),
            "HADOOP_USER_NAME": user,
            "PYTHONUNBUFFERED": "1",
        })
        env.setdefault("HADOOP_CONF_DIR", "{{PWD}}/" + _CONF)
        report_url = f"{stager.root}/{adir}/am-report.json"
        plan = {
            "user": user, "attempt": attempt, "report": report_url, "command": command,
            "log_tail_bytes": 4096, "env": env,
            "resources": shared + [stager.resource(_SECRET, secret_url)],
            "tasks": [{"type": kind, "instances": spec.instances, "memory_mb": spec.memory_mb,
                       "vcores": spec.vcores, "node_label": spec.label.value}
                      for kind, spec in task_specs.items()],
        }
        plan_url = stager.put_bytes(f"{adir}/{_PLAN}", json.dumps(plan, indent=1).encode())
        app = rm.new_application()
        app_id = app["application-id"]
        _check_capacity(task_specs, app.get("maximum-resource-capability") or {})
        app_ids.append(app_id)
        _submit(rm, app_id, name, queue, am_mb, user, [
            am_jar, stager.resource(_PLAN, plan_url),
            next(r for r in shared if r["name"] == _CONF)], stager.conf_dir)
        logger.info(f"{name}: attempt {attempt} submitted as {app_id} "
                    f"({', '.join(f'{k} x{s.instances}' for k, s in task_specs.items())}; "
                    f"{rm_web}/cluster/app/{app_id})")
        try:
            return _watch(rm, server, app_id, attempt, topo, report_url, stager, timeout)
        except BaseException:
            # interrupted, or the RM stopped answering: do not leave it running
            try:
                rm.kill(app_id)
            except Exception:
                pass
            raise
    finally:
        server.close()


def _check_capacity(task_specs: Mapping[str, TaskSpec], most: Mapping[str, Any]) -> None:
    """A container larger than the cluster's largest would fail the AM's
    request; say so before submitting."""
    for kind, spec in task_specs.items():
        for what, asked, limit in (("memory", spec.memory_mb, most.get("memory")),
                                   ("vcores", spec.vcores, most.get("vCores"))):
            if limit is not None and asked > int(limit):
                raise ValueError(f"task_specs[{kind!r}] asks for {asked} "
                                 f"{'MiB' if what == 'memory' else 'vcores'}; the cluster's "
                                 f"largest container has {limit}")


def _submit(rm: _ResourceManager, app_id: str, name: str, queue: str, am_mb: int, user: str,
            resources: List[Dict[str, Any]], conf_dir: str) -> None:
    """POST /ws/v1/cluster/apps: the AM's container launch context."""
    app_cp = _app_classpath(conf_dir)
    extra = [p for p in os.environ.get("EMBER_YARN_AM_CLASSPATH", "").split(os.pathsep) if p]
    classpath = "<CPS>".join(["{{PWD}}/" + _AM_JAR, "{{PWD}}/" + _CONF, *app_cp, *extra])
    env = {"CLASSPATH": classpath, "HADOOP_USER_NAME": user}
    java_home = _java_home()
    if java_home:
        env["JAVA_HOME"] = java_home
    cmd = " ".join(["{{JAVA_HOME}}/bin/java", f"-Xmx{max(128, am_mb * 3 // 4)}m",
                    "-Djava.net.preferIPv4Stack=true", *JAVA17_OPENS,
                    "org.ember.yarn.EmberAppMaster", _PLAN,
                    "1><LOG_DIR>/AppMaster.stdout", "2><LOG_DIR>/AppMaster.stderr"])
    am_spec: Dict[str, Any] = {
        "local-resources": {"entry": [
            {"key": r["name"], "value": {"resource": r["uri"], "type": r["type"],
                                         "visibility": "APPLICATION", "size": r["size"],
                                         "timestamp": r["timestamp"]}}
            for r in resources]},
        "commands": {"command": cmd},
        "environment": {"entry": [{"key": k, "value": v} for k, v in env.items()]},
    }
    if rm.auth.kerberos:
        # Containers have no Kerberos ticket: they reach HDFS with a
        # delegation token, obtained here (as skein and Spark do) for the
        # ResourceManager to renew while the application runs and to cancel
        # after it; the AM hands it on to every task (HADOOP_TOKEN_FILE_LOCATION).
        token = _ember.hdfs_delegation_token(hdfs.default_fs(conf_dir), rm.auth.renewer(),
                                             conf_dir=conf_dir)
        am_spec["credentials"] = {"tokens": {"entry": [{"key": "ember-hdfs", "value": token}]},
                                  "secrets": {"entry": []}}
    rm.submit({
        "application-id": app_id,
        "application-name": name,
        "queue": queue,
        "am-container-spec": am_spec,
        "unmanaged-AM": False,
        # the client retries whole applications (fresh rendezvous and secret)
        "max-app-attempts": 1,
        "resource": {"memory": am_mb, "vCores": 1},
        "application-type": "EMBER",
        "keep-containers-across-application-attempts": False,
    })
    # Without an authentication filter on the RM's web app (core-site's
    # hadoop.http.filter.initializers), user.name is ignored and the
    # application runs as the static web user: it could not read our 0700
    # staging directory, so say what to change instead of failing obscurely.
    owner = rm.app(app_id).get("user")
    if owner and owner != user:
        try:
            rm.kill(app_id)
        except RuntimeError:
            pass
        raise RuntimeError(
            f"the ResourceManager ran {app_id} as {owner!r}, not {user!r}: its REST API "
            "ignores user.name without an authentication filter; set "
            "hadoop.http.filter.initializers=org.apache.hadoop.security."
            "AuthenticationFilterInitializer and hadoop.http.authentication.type=simple")


def _app_classpath(conf_dir: str) -> List[str]:
    """yarn.application.classpath of the client configuration, else YARN's default."""
    raw = hdfs._conf_props(os.path.join(conf_dir, "yarn-site.xml")).get(
        "yarn.application.classpath", "")
    parts = [p.strip() for p in raw.split(",") if p.strip()]
    return parts or list(_DEFAULT_APP_CLASSPATH)


def _watch(rm: _ResourceManager, server: Any, app_id: str, attempt: int, topo: Dict[str, int],
           report_url: str, stager: _Stager,
           timeout: float) -> Tuple[Optional[Metrics], Optional[RunFailed]]:
    """Waits for the application to end, collecting the nodes' reports."""
    done: Dict[str, Dict[str, Any]] = {}
    failed: Dict[str, str] = {}
    deadline = time.monotonic() + timeout
    state, app = "", {}
    next_poll = 0.0
    killed_for = ""
    tb_url: Optional[str] = None
    tb_file = report_url.rsplit("/", 1)[0] + "/tensorboard.url"
    next_tb = time.monotonic() + 5.0 if topo.get("tensorboard") else float("inf")

    def read_tb_url() -> Optional[str]:
        """The tensorboard task's URL once it has published it (by rename: whole)."""
        try:
            return _ember.hdfs_read(tb_file, conf_dir=stager.conf_dir).decode() or None
        except Exception:
            return None

    state_final = [False]  # after the end, ps/tensorboard going away is no news
    errors = 0

    def drain(wait: float) -> None:
        while True:
            ev = server.next_event(wait)
            if ev is None:
                return
            kind, node, code, text = ev
            who = role_of(node, topo) if node >= 0 else "?"
            if kind == "done":
                try:
                    done[who] = json.loads(text) if text else {}
                except ValueError:
                    done[who] = {"metrics": None, "raw": text}
            elif kind == "failed":
                failed.setdefault(who, text)
                logger.warning(f"{app_id}: {who} failed (exit code {code})")
            elif kind == "progress":  # ctx.report_progress: the task's line, named
                logger.info(f"{app_id}: {who}: {text}")
            elif kind == "lost" and not state_final[0]:
                logger.warning(f"{app_id}: lost contact with {who}")
            elif kind == "rejected":
                logger.warning(f"{app_id}: {text}")  # rate-limited for strangers (C server)
            wait = 0.0

    while True:
        drain(0.5)
        now = time.monotonic()
        if now >= next_poll:
            next_poll = now + 1.0
            try:
                app = rm.app(app_id)
                errors = 0
            except RuntimeError as e:  # a ResourceManager restart or failover
                errors += 1
                if errors >= 30:
                    raise RuntimeError(f"{app_id}: the ResourceManager did not answer for "
                                       f"30 s: {e}") from None
                continue
            state = app.get("state", "")
            if state in ("FINISHED", "FAILED", "KILLED"):
                state_final[0] = True
                break
        if now >= next_tb:  # the tensorboard task publishes its URL there
            next_tb = now + 5.0
            tb_url = read_tb_url()
            if tb_url:
                logger.info(f"{app_id}: TensorBoard at {tb_url}")
                next_tb = float("inf")
        if now > deadline and not killed_for:
            killed_for = f"timed out after {timeout:.0f} s (timeout=) in state {state}"
            logger.warning(f"{app_id}: {killed_for}; killing it (give run_on_yarn a larger "
                           "timeout if it needs longer)")
            rm.kill(app_id)
        if now > deadline + 120:
            raise RuntimeError(f"{app_id} is still {state} 120 s after it was killed")
    if topo.get("tensorboard") and tb_url is None:
        tb_url = read_tb_url()  # None: it never got to serve
    # reports sent just before the containers exited may still be queued
    end = time.monotonic() + 5.0
    deciding = [r for r in ("chief", "worker", "evaluator") for _ in range(topo[r])]
    while time.monotonic() < end and len(done) + len(failed) < len(deciding):
        drain(0.2)
    drain(0.0)

    report: Dict[str, Any] = {}
    try:
        report = json.loads(_ember.hdfs_read(report_url, conf_dir=stager.conf_dir))
    except Exception as e:  # the AM died before writing it
        logger.info(f"{app_id}: no AM report ({e})")
    final = app.get("finalStatus", "")
    by_container = {t["task"]: t for t in report.get("tasks", [])}
    nb_proc = topo["nb_proc"]

    def container_of(task: str) -> Dict[str, Any]:
        kind, _, idx = task.partition(":")
        if kind == "worker" and nb_proc > 1:
            task = f"worker:{int(idx) // nb_proc}"
        return by_container.get(task, {})

    if state == "FINISHED" and final == "SUCCEEDED" and not failed:
        tasks: Dict[str, TaskResult] = {}
        names = set(done) | {t for t in by_container if not t.startswith("worker:")
                             or nb_proc == 1}
        for task in sorted(names):
            c, d = container_of(task), done.get(task, {})
            tasks[task] = TaskResult(task, c.get("exit_status"), d.get("wall_s"),
                                     d.get("metrics"), c.get("container") or d.get("container"),
                                     c.get("host") or d.get("host"),
                                     bool(c.get("stopped_by_am")))
        return Metrics(tasks, [app_id], 0.0, tb_url), None

    # failure: name the task the AM saw fail first, else the first report
    task = report.get("failed_task") or next(iter(failed), None)
    tb = failed.get(task or "", "") or next(iter(failed.values()), "")
    c = container_of(task) if task else {}
    logs = dict(c.get("log_tail") or {})
    diag = (report.get("diagnostics") or app.get("diagnostics") or "").strip()
    if not report:
        logs["AppMaster.stderr"] = rm.am_log_tail(app_id)
    lines = [f"attempt {attempt} ({app_id}) ended {state}/{final}"
             + (f": task {task} failed" if task else "")
             + (f" (container {c.get('container')} on {c.get('host')}, exit status "
                f"{c.get('exit_status')})" if c.get("container") else "")
             + (f"; {killed_for}" if killed_for else "")]
    if tb:
        lines.append(f"--- traceback of {task} ---\n{tb.rstrip()}")
    for fname, text in logs.items():
        lines.append(f"--- {task or 'AM'} {fname} (last {len(text)} bytes) ---\n{text.rstrip()}")
    if diag and not logs:
        lines.append(f"--- YARN diagnostics ---\n{diag[-4000:]}")
    return None, RunFailed("\n".join(lines), task, [app_id], tb, logs, [])
