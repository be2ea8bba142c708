"""The cluster's key limit (blobstore.keys.max), on a real cluster: a create past it is refused
with RESOURCE_EXHAUSTED and a message that says what to do, before ZooKeeper runs out of heap,
and a delete makes room again."""

from __future__ import annotations

import pytest
from support.harness import client_for, wait_until

from blobha.core.errors import ResourceExhausted
from blobha.ops.localcluster import LocalCluster

pytestmark = pytest.mark.integration

LIMIT = 3


@pytest.mark.parametrize("fresh_cluster", [{"blobstore.keys.max": LIMIT}], indirect=True)
def test_a_create_past_the_clusters_key_limit_is_refused_and_a_delete_makes_room(
        fresh_cluster: LocalCluster) -> None:
    with client_for(fresh_cluster) as c:
        for i in range(LIMIT):
            c.create(f"cap-{i}", b"x")
        with pytest.raises(ResourceExhausted) as e:
            c.create("cap-over", b"x")
        message = str(e.value)
        assert "blobstore.keys.max is 3" in message and "\n" not in message, message
        # Nothing half-written.
        assert sorted(c.list()) == [f"cap-{i}" for i in range(LIMIT)]
        # Updates add no key.
        assert c.update("cap-0", b"y").version == 2
        c.delete("cap-1")

        def room() -> bool:
            try:
                c.create("cap-over", b"x")
                return True
            except ResourceExhausted:
                return False

        wait_until(room, 10, "a create once a key was deleted")
