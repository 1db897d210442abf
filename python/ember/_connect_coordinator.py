"""The coordinator of a cluster run from a Spark Connect client: what a
classic driver does for its nodes, in a process of its own on an executor
host (the client may sit where no executor reaches it).

``python -m ember._connect_coordinator`` reads its boot record (JSON: the
job secret as hex, the roles, timeouts, the address to bind) from stdin,
hosts the nodes' rendezvous (heartbeats, failures, STOP) and a control
channel, and prints ``ports <rendezvous> <control>``, then ``ready <nodes
as JSON>`` once every node registered (or ``failed <why>``), on stdout for
the barrier task that started it (:mod:`ember._connect_stage`).

The control channel is a feed server taking inference-style requests (one
JSON record, one JSON result), so it is authenticated with the job secret
and as hardened against hostile peers as every feed: ``{"op": "state"}``
answers the nodes' states and the first failure; ``{"op": "resume"}``,
after a restart, the epochs the fed nodes resume from; ``{"op": "finish",
"end_feed": true}`` ends the fed nodes' feeds, waits until the chief and
workers are done (or one fails), stops the others and answers the final
states; ``{"op": "stop"}`` stops every node.  The process exits after a
finish or stop, or ten minutes after every node ended without one.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from typing import Any, Dict, List, Optional

from ember import _ember
from ember.executor import node_failure, node_name
from ember.node import CHECKPOINT_REPORT, RESUME_REPORT, SERVING_REPORT, DataFeed

logger = logging.getLogger("ember.connect")

TRAINER_ROLES = ("chief", "worker")
_ORPHAN_WAIT = 600.0  # s the coordinator outlives its nodes, waiting for the client's finish


class Coordinator:
    def __init__(self, boot: Dict[str, Any]) -> None:
        self.boot = boot
        self.secret = bytes.fromhex(boot["secret"])
        self.heartbeat_timeout = float(boot["heartbeat_timeout"])
        self.server = _ember.RendezvousServer(
            self.secret, int(boot["num_nodes"]),
            heartbeat_timeout_ms=int(self.heartbeat_timeout * 1000), host=boot["host"],
            **boot["roles"])
        self.control = _ember.FeedServer(self.secret, host=boot["host"],
                                         encrypt=bool(boot["encrypt"]))
        self.nodes: List[Dict[str, Any]] = []
        self.states: Dict[int, str] = {}
        self.failure: Optional[Dict[str, Any]] = None
        self.serving: set = set()
        #: fed node -> the epoch its main_fun resumes from (ctx.resume_from),
        #: None when it read its feed without naming one
        self.resume: Dict[int, Optional[int]] = {}
        self.lock = threading.Condition()

    # -- the nodes --------------------------------------------------------------
    def wait_ready(self) -> None:
        self.server.wait_ready(float(self.boot["reservation_timeout"]))
        self.nodes = sorted(self.server.nodes(), key=lambda n: n["index"])
        self.states = {n["index"]: "running" for n in self.nodes}

    def watch(self) -> None:
        by_index = {n["index"]: n for n in self.nodes}
        while True:
            try:
                ev = self.server.next_event(0.5)
            except ValueError:  # closed
                return
            if ev is None:
                continue
            kind, node, code, text = ev
            if kind == "progress":
                if code in (SERVING_REPORT, RESUME_REPORT):
                    with self.lock:
                        if code == SERVING_REPORT:
                            self.serving.add(node)
                        else:
                            self.resume[node] = int(text) if text and text.isdigit() else None
                        self.lock.notify_all()
                elif code != CHECKPOINT_REPORT:
                    logger.info(f"{node_name(by_index[node])}: {text}")
                continue
            if kind == "rejected":
                logger.warning(text)
                continue
            if kind not in ("done", "failed", "lost"):
                continue  # registered, ready
            with self.lock:
                if kind == "done":
                    self.states[node] = "done"
                elif self.states.get(node) != "stopping":
                    self.states[node] = kind
                    if self.failure is None:
                        self.failure = dict(node=node, kind=kind, message=node_failure(
                            node_name(by_index[node]), kind, code, text,
                            self.heartbeat_timeout))
                        # the others cannot go on without it: their feeds and
                        # collectives end, and so do the client's feeding jobs
                        self._stop_locked()
                self.lock.notify_all()

    def _stop_locked(self) -> None:
        for i, s in self.states.items():
            if s == "running":
                self.states[i] = "stopping"
        self.server.stop(-1, 5000)

    def report(self) -> Dict[str, Any]:
        with self.lock:
            return dict(states={str(k): v for k, v in self.states.items()},
                        failure=self.failure)

    def finish(self, end_feed: bool, timeout: float) -> Dict[str, Any]:
        if end_feed:
            for n in self.nodes:
                if n["role"] in self.boot["feed_roles"] and self.states.get(n["index"]) \
                        == "running":
                    self._end_feed(n)
        trainers = [n["index"] for n in self.nodes if n["role"] in TRAINER_ROLES]
        deadline = time.monotonic() + timeout
        with self.lock:
            while self.failure is None and any(
                    self.states.get(i) != "done" and i not in self.serving for i in trainers):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.lock.wait(min(left, 0.5))
            self._stop_locked()
        return self.report()

    def await_resume(self, timeout: float) -> Dict[str, Any]:
        """Waits until every fed node has named where it resumes from, read its
        feed without naming one, or ended; answers the positions named."""
        fed = [n["index"] for n in self.nodes if n["role"] in self.boot["feed_roles"]]
        deadline = time.monotonic() + timeout
        with self.lock:
            while self.failure is None:
                waiting = [i for i in fed if i not in self.resume
                           and self.states.get(i) == "running"]
                if not waiting or time.monotonic() >= deadline:
                    break
                self.lock.wait(0.5)
            named = [p for p in (self.resume.get(i) for i in fed) if p is not None]
        return dict(self.report(), resume=named, waiting=waiting)

    def _end_feed(self, node: Dict[str, Any]) -> None:
        try:
            client = _ember.FeedClient(node["host"], int(node["ports"][1]), self.secret,
                                       0xFFFFFFFF, encrypt=bool(self.boot["encrypt"]),
                                       timeout_s=10.0)
            try:
                client.end_feed(10.0)
            finally:
                client.close()
        except _ember.EmberError as exc:  # a node already gone has nothing to end
            logger.info(f"end of feed not delivered to {node_name(node)}: {exc}")

    def ended(self) -> bool:
        with self.lock:
            return all(s in ("done", "failed", "lost", "stopping")
                       for s in self.states.values())

    # -- the control channel ------------------------------------------------------
    def serve(self) -> None:
        feed = DataFeed(self.control, train_mode=False, feed_timeout=600.0,
                        node_name="coordinator")
        ended_at: Optional[float] = None
        while True:
            batch = feed.next_batch(1)
            if len(batch) == 0:
                if self.ended():
                    ended_at = ended_at or time.monotonic()
                    if time.monotonic() - ended_at > _ORPHAN_WAIT:
                        return
                time.sleep(0.05)
                continue
            try:
                request = json.loads(str(batch.columns[0][0]))
                op = request.get("op")
                if op == "state":
                    reply = self.report()
                elif op == "resume":
                    reply = self.await_resume(float(request.get("timeout", 600)))
                elif op == "finish":
                    reply = self.finish(bool(request.get("end_feed")),
                                        float(request.get("timeout", 259200)))
                elif op == "stop":
                    with self.lock:
                        self._stop_locked()
                    reply = self.report()
                else:
                    reply = dict(error=f"unknown request {op!r}")
            except (ValueError, AttributeError, TypeError) as exc:
                op, reply = None, dict(error=f"bad request: {exc}")
            feed.batch_results([json.dumps(reply)])
            if op in ("finish", "stop"):
                # read on until the asking task's partition ends (its end is
                # acknowledged as it is read), then go
                until = time.monotonic() + 2.0
                while time.monotonic() < until and not feed.should_stop():
                    feed.next_batch(1)
                    time.sleep(0.02)
                return

    def close(self) -> None:
        self.server.close()
        self.control.close()


def _tell(line: str) -> None:
    """One line of the start-up protocol, to the barrier task reading our stdout."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    boot = json.loads(sys.stdin.read())
    coordinator = Coordinator(boot)
    _tell(f"ports {coordinator.server.port} {coordinator.control.port}")
    try:
        try:
            coordinator.wait_ready()
        except _ember.EmberError as exc:
            _tell(f"failed {' '.join(str(exc).split())}")
            return 1
        _tell("ready " + json.dumps(coordinator.nodes))
        sys.stdout.close()
        threading.Thread(target=coordinator.watch, name="ember-watch", daemon=True).start()
        coordinator.serve()
    finally:
        coordinator.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
