"""`Cluster.shutdown` stops only what `connect` started or joined: a Ray connection someone else made in this
process (a test session's cluster, a user's notebook) is left alone."""
from orchestrator.cluster import connect


def test_shutdown_leaves_a_connection_made_elsewhere_alone(ray_cluster):
    import ray

    cluster = connect(None, "tide_test")
    assert not cluster.connected_here
    cluster.shutdown()
    assert ray.is_initialized()
    assert ray.get(ray.put(7), timeout=30) == 7
