"""Which fed node gets which partition of a ``train()`` call.

The call's partitions are numbered epoch-major: partition ``p`` is partition
``p % per_epoch`` of the data, in epoch ``p // per_epoch``.  By default
partition ``p`` goes to fed node ``p % nodes``.  A call may carry *routes*
instead: the node of each of the data's partitions, the same in every
epoch (``routes[p % per_epoch]``).  The driver chooses routes when the
data's partitions are cached (or stored) on the fed nodes' hosts and
round-robin would send them elsewhere (:func:`local_routes`): a feeding
task then reads its node's partitions where they are, instead of fetching
them from another host's executor.

The driver, the feeding tasks and the nodes all route with these functions
(pure Python, no Spark: the nodes import this module).
"""

from __future__ import annotations

import functools
import socket
from typing import AbstractSet, FrozenSet, List, Optional, Sequence


def node_of(p: int, nodes: int, routes: Optional[Sequence[int]] = None) -> int:
    """The fed node (0..nodes-1) that gets the call's partition ``p``."""
    return int(routes[p % len(routes)]) if routes else p % nodes


def node_partitions(node: int, first: int, parts: int, nodes: int,
                    routes: Optional[Sequence[int]] = None) -> List[int]:
    """The call's partitions ``first..parts-1`` that fed node ``node`` gets, in
    the order its feeding task feeds them."""
    if not routes:
        return list(range(first + (node - first) % nodes, parts, nodes))
    return [p for p in range(first, parts) if routes[p % len(routes)] == node]


def node_share(p: int, first: int, parts: int, nodes: int,
               routes: Optional[Sequence[int]] = None) -> int:
    """How many of the call's partitions ``first..parts-1`` go to the node that
    gets partition ``p``: the feed ends the call for that node after as many
    partition ends (CALL_END, ember/feed.h).  Asked on every partition's
    connection, so it counts per epoch rather than walking the call."""
    node = node_of(p, nodes, routes)
    if not routes:
        return len(range(first + (node - first) % nodes, parts, nodes))
    mine = [i for i, n in enumerate(routes) if n == node]

    def before(q: int) -> int:  # the node's partitions among 0..q-1
        epochs, rest = divmod(q, len(routes))
        return epochs * len(mine) + sum(1 for i in mine if i < rest)

    return before(parts) - before(first)


def local_routes(where: Sequence[AbstractSet[str]], node_hosts: Sequence[AbstractSet[str]]
                 ) -> Optional[List[int]]:
    """Routes that give each fed node the data's partitions stored on its host,
    as many partitions per node as round-robin gives; None when they would
    not read more partitions locally than round-robin does.

    ``where[i]``: the hosts holding the data's partition ``i`` (its cached
    blocks' executors' hosts, or a file's block hosts; empty when unknown);
    ``node_hosts[n]``: the names of fed node ``n``'s host.  Only for a count
    of partitions that the nodes divide: each node then gets the same share
    of every epoch, as round-robin gives it, and the rest of the call (the
    epochs' accounting, a resume from an epoch) is unchanged.
    """
    count, nodes = len(where), len(node_hosts)
    if nodes < 2 or count < nodes or count % nodes:
        return None
    local = [[n for n in range(nodes) if where[i] & node_hosts[n]] for i in range(count)]
    share = count // nodes
    routes: List[Optional[int]] = [None] * count
    load = [0] * nodes
    # partitions with the fewest local nodes first, so that one held by a
    # single node's host is not left without it; round-robin's node first
    for i in sorted(range(count), key=lambda i: (len(local[i]) or nodes + 1, i)):
        for n in sorted(local[i], key=lambda n: (n != i % nodes, load[n])):
            if load[n] < share:
                routes[i], load[n] = n, load[n] + 1
                break
    for i in range(count):  # the rest: where there is room, round-robin's node first
        if routes[i] is None:
            n = min(range(nodes), key=lambda n: (load[n] >= share, n != i % nodes, n))
            routes[i], load[n] = n, load[n] + 1

    def reads_locally(route: Sequence[int]) -> int:
        return sum(route[i] in local[i] for i in range(count))

    chosen = [int(n) for n in routes if n is not None]
    if reads_locally(chosen) <= reads_locally([i % nodes for i in range(count)]):
        return None
    return chosen


@functools.lru_cache(maxsize=256)
def host_names(host: str) -> FrozenSet[str]:
    """``host`` and its address: Spark names an executor's host as it
    registered, a node as it advertises itself, and either may be a name or
    an address."""
    try:
        return frozenset((host, socket.gethostbyname(host)))
    except (OSError, UnicodeError):
        return frozenset((host,))
