"""The node process: ``python -m ember._trainer`` (started by a barrier task).

Why a detached process: a barrier task that ran the trainer for the cluster's
whole life would hold its executor slot, leaving no slot for the tasks of
``cluster.train(rdd)`` (the deadlock TensorFlowOnSpark avoided the same way).
So the barrier task only launches this process in its own session and process
group, waits until it has registered, and returns.  From then on the node is
watched by Ember's control plane, not by Spark: it heartbeats to the driver's
rendezvous server, reports DONE or FAILED with its traceback, and kills its own
process group if the driver connection is lost or a STOP's grace runs out (C,
``ember_rdv_client_start`` with EMBER_RDV_EXIT_ON_LOSS).

A frozen node (SIGSTOP) runs no thread, so it cannot kill itself: its
watchdog, a small process beside it (``ember._watchdog``), kills its process
group once it has not run for ``heartbeat_timeout`` (the launcher passes it
as ``argv[1]``, and the node's index as ``argv[2]``).

Protocol with the launcher: the bootstrap (a cloudpickled dict produced by the
launcher in the same executor) arrives on stdin; this process answers one line
on stdout, ``registered`` or ``error: <reason>``, then points stdout at stderr.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import socket
import sys
import time
import traceback
from typing import Any, Dict, List

from ember import _imports, _log, _watchdog
from ember._env import bind_host

FEED_ROLES = ("chief", "worker")


def cluster_spec_of(nodes: List[Dict[str, Any]]) -> Dict[str, List[str]]:
    """TensorFlow's cluster spec: role -> ["host:port"], evaluator excluded."""
    spec: Dict[str, List[str]] = {}
    for n in sorted(nodes, key=lambda n: (n["role"], n["task_index"])):
        if n["role"] != "evaluator":
            spec.setdefault(n["role"], []).append(f"{n['host']}:{n['ports'][0]}")
    return spec


def framework_env(nodes: List[Dict[str, Any]], me: Dict[str, Any]) -> Dict[str, str]:
    """TF_CONFIG for TensorFlow and MASTER_ADDR/RANK/... for torch.distributed."""
    spec = cluster_spec_of(nodes)
    env = {"TF_CONFIG": json.dumps({"cluster": spec,
                                    "task": {"type": me["role"], "index": me["task_index"]}})}
    trainers = [n for n in nodes if n["role"] in FEED_ROLES]  # chief first, then workers
    trainers.sort(key=lambda n: (n["role"] != "chief", n["task_index"]))
    if trainers and me["role"] in FEED_ROLES:
        master = trainers[0]
        env.update(MASTER_ADDR=master["host"], MASTER_PORT=str(master["ports"][0]),
                   RANK=str(trainers.index(me)), WORLD_SIZE=str(len(trainers)))
    return env


def _fault(boot: Dict[str, Any], name: str) -> str:
    """Fault injection for tests (EMBER_FAULT_<NAME>=<node index>[:<arg>])."""
    value = os.environ.get("EMBER_FAULT_" + name.upper(), "")
    index, _, arg = value.partition(":")
    if not value or index != str(boot["index"]):
        return ""
    return arg or "1"


def main() -> None:
    # this process's Ember lines (its watchdog's too) go to the executor's
    # stderr with a timestamp, unless main_fun configures logging (ember._log)
    # (argv[2], the node's index, names it in every line, the watchdog's too)
    name = f"node {sys.argv[2]}" if len(sys.argv) > 2 else "node"
    _log.default_handler(name)
    # before main_fun's module is unpickled (it may import its framework)
    _imports.pause_collector_on_heavy_imports()
    # first, before any thread exists: the watchdog that ends this node if it
    # is frozen for heartbeat_timeout (argv[1], seconds; see ember._watchdog)
    _watchdog.start(float(sys.argv[1]) if len(sys.argv) > 1 else 0.0, name)
    boot = pickle.loads(sys.stdin.buffer.read())
    status = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # from here on, prints go to the executor's stderr
    sys.path[:0] = [p for p in boot["sys_path"] if p not in sys.path]
    os.environ.update(boot["env"])
    if boot.get("gpus"):  # the task's GPUs win over a CUDA_VISIBLE_DEVICES in env=
        from ember._gpu import cuda_env

        os.environ.update(cuda_env(boot["gpus"]))
    try:
        node = _register(boot, status)
    except BaseException as exc:  # the launcher turns this line into a task error
        status.write(f"error: {type(exc).__name__}: {exc}\n")
        status.close()
        os._exit(2)
    code = _run(boot, *node)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _register(boot: Dict[str, Any], status: Any) -> Any:
    from ember import _ember

    # Ember's listening sockets bind the address Spark uses for this node's
    # executor (ember._env.bind_host); the framework's port is only held (not
    # listening) until TensorFlow or torch binds it as it does itself
    host = boot.get("advertise_host", "")
    bind = bind_host(host)
    fw_fd, fw_port = _ember.reserve_port("", listen=False)
    feed_fd, feed_port = _ember.reserve_port(bind, listen=True)
    ports, held = [fw_port, feed_port], [fw_fd]
    if boot.get("tensorboard") and boot.get("tensorboard_node") == boot["index"]:
        tb_fd, tb_port = _ember.reserve_port(bind, listen=False)
        ports.append(tb_port)
        held.append(tb_fd)
    # the collectives' port goes last (ember.collective.trainer_addresses), listening
    # so that peers' connections queue until this node creates its communicator
    coll_fd, coll_port = _ember.reserve_port(bind, listen=True)
    ports.append(coll_port)
    delay = _fault(boot, "delay_register")
    if delay:
        time.sleep(float(delay))
    client = _ember.RendezvousClient(boot["driver_host"], boot["driver_port"], boot["secret"],
                                     boot["reservation_timeout"])
    client.register(boot["index"], host, boot["executor_id"], os.getpid(), ports,
                    boot["reservation_timeout"])
    status.write("registered\n")
    status.close()
    return client, held, feed_fd, coll_fd


def _start_tensorboard(log_dir: str, port_fd: int, port: int, bind: str) -> Any:
    """TensorBoard on the reserved port, in this node's process group.

    TensorBoard's server does not set SO_REUSEPORT, so Ember's hold on the port
    is dropped right before TensorBoard binds it (a window of one exec)."""
    import subprocess

    os.makedirs(log_dir, exist_ok=True)
    os.close(port_fd)
    return subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", log_dir,
                             "--port", str(port), *(["--host", bind] if bind else ["--bind_all"])],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _run(boot: Dict[str, Any], client: Any, held: List[int], feed_fd: int,
         coll_fd: int) -> int:
    from ember import _ember
    from ember.collective import Collective, trainer_addresses
    from ember.node import NodeContext

    spec, pos = client.wait_spec(boot["reservation_timeout"])
    nodes = spec.tolist()
    # silent for heartbeat_timeout, the driver is cut off by a partition: this
    # node ends itself as the driver counts it lost, before its replacement
    # runs (it must not train alone or write checkpoints; ember/rendezvous.h)
    client.start(boot["heartbeat_interval_ms"], exit_on_loss=True,
                 silence_ms=int(boot.get("heartbeat_timeout", 0) * 1000))
    _watchdog.arm()  # from now on a node that runs no thread is frozen
    me = nodes[pos]
    os.environ.update(framework_env(nodes, me))
    feed_server = None
    if boot["input_mode"] == 1 and me["role"] in FEED_ROLES:
        feed_server = _ember.FeedServer(boot["secret"], listen_fd=feed_fd,
                                        encrypt=bool(boot.get("encrypt")))
    else:
        os.close(feed_fd)
    ctx = NodeContext(
        executor_id=me["index"], worker_num=me["index"], job_name=me["role"],
        task_index=me["task_index"], cluster_spec=cluster_spec_of(nodes),
        num_workers=sum(1 for n in nodes if n["role"] in FEED_ROLES),
        host=me["host"], ports=list(me["ports"]), input_mode=boot["input_mode"],
        working_dir=boot.get("working_dir") or os.getcwd(), nodes=nodes,
        gpus=list(boot.get("gpus") or []),
        _feed_server=feed_server, _control=client, _reserved_fds=held[:1],
        _secret=boot["secret"], _encrypt=bool(boot.get("encrypt")))
    if me["role"] in FEED_ROLES:
        addresses = trainer_addresses(nodes)
        ctx._collective = Collective(int(os.environ["RANK"]), addresses, boot["secret"],
                                     listen_fd=coll_fd, encrypt=bool(boot.get("encrypt")))
    else:
        os.close(coll_fd)
    tensorboard = None
    if len(held) > 1 and importlib.util.find_spec("tensorboard") is None:
        # TensorFlow >= 2.21 no longer installs TensorBoard: say so, rather than
        # start a server that dies at once (its output goes to /dev/null)
        os.close(held.pop(1))
        ctx.report_progress("TensorBoard not started: the tensorboard package is not "
                            f"installed in this node's Python ({sys.executable}); "
                            "pip install tensorboard (TensorFlow >= 2.21 no longer brings it)")
    if len(held) > 1:
        log_dir = boot["log_dir"]
        tensorboard = _start_tensorboard(log_dir.split("://", 1)[-1] if log_dir.startswith(
            "file://") else log_dir, held[1], me["ports"][2],
            bind_host(boot.get("advertise_host", "")))
        ctx.report_progress(f"TensorBoard at http://{me['host']}:{me['ports'][2]} ({log_dir})")
    name = f"node {me['index']} ({me['role']}:{me['task_index']} on {socket.gethostname()})"
    code, text = 0, ""
    serves = me["role"] == "ps" and boot.get("parameter_servers") is not None
    try:
        if _fault(boot, "raise"):
            raise RuntimeError(f"injected failure in {name}")
        if serves:  # Ember's parameter server instead of main_fun (ember.ps)
            text = _serve_parameters(boot, nodes, me, ctx, client)
            result = None
        else:
            result = boot["main_fun"](boot["args"], ctx)
        if boot.get("report_result") and isinstance(result, str):
            text = result  # ember.yarn.task: the task's metrics (JSON) travel in DONE
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
        text = "" if code == 0 else f"{name}: main_fun called sys.exit({exc.code!r})"
    except BaseException:
        code, text = 1, f"{name}: main_fun raised:\n{traceback.format_exc()}"
    if ctx._feed_reader is not None:  # ember.tf.feed_dataset's op waits no more
        ctx._feed_reader.close()
        ctx._feed_reader = None
    if ctx._ps_client is not None:
        ctx._ps_client.finish_and_close(code == 0)  # the servers stop waiting for this worker
    if ctx._collective is not None:
        ctx._collective.close()  # peers still in a collective fail now, not at their timeout
    sys.stdout.flush()
    sys.stderr.flush()
    client.report("done" if code == 0 else "failed", code, text, 30.0)
    if feed_server is not None and code == 0:
        _linger(client, feed_server)
    elif feed_server is not None:
        feed_server.close()  # feeding tasks fail, and train() raises this node's error
    _watchdog.disarm()  # the heartbeats stop here; an ending node may idle
    client.close()
    ctx.release_port()
    if tensorboard is not None:
        tensorboard.terminate()
        tensorboard.wait(10)
    return code


def _serve_parameters(boot: Dict[str, Any], nodes: List[Dict[str, Any]], me: Dict[str, Any],
                      ctx: Any, client: Any) -> str:
    """A ps node's life under Ember's parameter server: its shard served on
    the framework port until every worker finished or the driver stops it."""
    from ember import ps

    listen_fd = ctx._reserved_fds.pop(0)  # the server takes the bound socket over
    ctx.report_progress(f"serving parameter-server shard {me['task_index']} on port "
                        f"{me['ports'][0]}")
    why = ps.serve(nodes, me, boot["secret"], listen_fd, boot["parameter_servers"],
                   bool(boot.get("encrypt")), lambda: client.stop_state() != 0)
    return f"parameter-server shard {me['task_index']}: {why}"


def _linger(client: Any, feed_server: Any) -> None:
    """Keeps the feed answering after main_fun returned, until shutdown.

    A trainer may stop before the data ends (fixed step count).  Feeding tasks
    must then finish, not fail, so the feed is terminated (their partitions are
    acknowledged as dropped) and stays up until the driver's END_FEED or STOP.
    """
    feed_server.terminate()
    # After terminate, next() answers "end" at once, so it cannot tell when
    # the driver is done: wait for its STOP (sent by shutdown) instead.
    # Closing earlier would cut off feeding tasks still ending their
    # partitions (e.g. right after the trainer read its last partition).
    while client.stop_state() == 0:
        time.sleep(0.2)
    feed_server.close()


if __name__ == "__main__":
    main()
