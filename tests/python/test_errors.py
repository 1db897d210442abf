"""ember.errors: which node failures the driver counts as a peer's casualty
rather than a cause (Cluster._failure prefers the node that vanished)."""

from ember.errors import EmberNodeError

TF_ABORT = ("node 0 (chief:0 on vm): main_fun raised:\n... tensorflow.python.framework."
            "errors_impl.UnavailableError: Collective ops is aborted by: failed to connect "
            "to all addresses\nThe error could be from a previous operation. Restart your "
            "program to reset.\n\t [[{{node CollectiveReduceV2}}]]")


def test_collective_aborts_of_ember_tensorflow_and_gloo_are_casualties():
    ember = "allreduce: rank 1 (10.0.0.2:4000) failed, was killed or left)"
    gloo = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] " \
           "Connection closed by peer [10.0.0.2]:4000"
    for text in (ember, TF_ABORT, gloo):
        assert EmberNodeError(f"ember node 0 failed:\n{text}", 0, "failed").peer_vanished


def test_own_errors_and_lost_nodes_are_causes():
    assert not EmberNodeError("ember node 1 failed:\nValueError: bad shape", 1).peer_vanished
    # a lost node is the cause even when its last words mention a collective
    assert not EmberNodeError(f"ember node 1 was lost:\n{TF_ABORT}", 1, "lost").peer_vanished
