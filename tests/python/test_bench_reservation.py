"""The Ember half of bench/reservation.py at N=64, through the benchmark's own
code path (server process, node processes, one thread per node).  No timing
assertions: this only proves the harness and the rendezvous are correct."""

from __future__ import annotations

import collections
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "bench"))

import reservation as bench  # noqa: E402


def test_ember_64_nodes_get_the_full_spec_with_roles():
    n = 64
    bench.raise_nofile()
    with bench.NodePool(4) as pool:
        tr = bench.run_trial(pool, "ember", n, limit=60, check="all")
    assert tr.ok, tr.summary()
    assert tr.errors == {}
    assert tr.completed == n
    assert sorted(r[0] for r in tr.nodes) == list(range(n))
    for (index, t_conn, t_reg, t_done, error, entries, role, task_index, full) in tr.nodes:
        assert error is None, (index, error)
        assert t_done is not None
        assert entries == n, (index, entries)
        assert full == "ok", (index, full)          # every row's index, role and task_index
        assert (role, task_index) == bench.expected_role(index, n)
    roles = collections.Counter(r[6] for r in tr.nodes)
    assert roles == {"ps": bench.NUM_PS, "chief": 1, "worker": n - bench.NUM_PS - 1}
    # the server saw every node register, become ready once, and finish cleanly
    assert tr.server_events.get("registered") == n
    assert tr.server_events.get("ready") == 1
    assert tr.server_events.get("done") == n
    assert tr.server_notes == []
