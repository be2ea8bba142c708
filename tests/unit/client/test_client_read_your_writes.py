"""Read-your-writes on the client: the bounded memory of what it has seen, the rule that
compares a minimum with a master's view, and the routing of a read a master refuses as stale
(masters in memory, each with a view of its own)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from support.steer import Steer

from blobha.client import Client
from blobha.client import retry as retry_mod
from blobha.client.seen import DEFAULT_REMEMBERED_KEYS, SeenVersions
from blobha.core.consistency import DELETED, MinVersion
from blobha.core.digest import digest_bytes
from blobha.core.errors import InvalidArgument, KeyNotFound, NotLeader, Stale, Unavailable
from blobha.v1 import blobha_pb2 as pb
from blobha.wire.convert import min_version_from_pb

M1, M2, M3 = "m1:6627", "m2:6627", "m3:6627"
CREATED = 1_700_000_000.0


# -- the rule ------------------------------------------------------------------------------


def test_a_view_is_behind_an_older_version_or_incarnation_only() -> None:
    seen = MinVersion(3, CREATED)
    assert seen.newer_than(2, CREATED)
    assert not seen.newer_than(3, CREATED) and not seen.newer_than(4, CREATED)
    # Versions count again from 1 after a delete and create: the creation time orders them.
    assert seen.newer_than(9, CREATED - 1)
    assert not seen.newer_than(1, CREATED + 1)
    assert seen.merge(MinVersion(2, CREATED)) == seen
    assert seen.merge(MinVersion(1, CREATED + 1)) == MinVersion(1, CREATED + 1)


def test_a_deleted_key_is_newer_than_every_version_of_its_incarnation() -> None:
    gone = MinVersion(DELETED, CREATED)
    assert gone.newer_than(10**9, CREATED)
    assert not gone.newer_than(1, CREATED + 1)  # created again since
    assert gone.describe() == "the key deleted" and MinVersion(2, CREATED).describe() == "v2"


# -- the memory ----------------------------------------------------------------------------


def test_the_memory_keeps_the_newest_version_of_each_key() -> None:
    seen = SeenVersions()
    assert seen.capacity == DEFAULT_REMEMBERED_KEYS
    assert seen.minimum("k") is None
    seen.saw("k", 3, CREATED)
    seen.saw("k", 2, CREATED)  # an older read does not lower it
    assert seen.minimum("k") == MinVersion(3, CREATED)
    seen.saw("k", 0, CREATED)  # nothing read
    seen.saw("k", 9, 0.0)  # a master that does not say when the key was made teaches nothing
    assert seen.minimum("k") == MinVersion(3, CREATED)
    seen.deleted("k", CREATED)
    assert seen.minimum("k") == MinVersion(DELETED, CREATED)
    seen.saw("k", 1, CREATED + 5)  # created again
    assert seen.minimum("k") == MinVersion(1, CREATED + 5)


def test_the_memory_drops_the_least_recently_used_key_beyond_its_bound() -> None:
    seen = SeenVersions(capacity=2)
    seen.saw("a", 1, CREATED)
    seen.saw("b", 1, CREATED)
    assert seen.minimum("a") is not None  # used: "b" is now the oldest
    seen.saw("c", 1, CREATED)
    assert len(seen) == 2
    assert seen.minimum("b") is None
    assert seen.minimum("a") == seen.minimum("c") == MinVersion(1, CREATED)


def test_a_memory_of_no_keys_remembers_nothing() -> None:
    seen = SeenVersions(capacity=0)
    seen.saw("a", 1, CREATED)
    assert seen.minimum("a") is None and len(seen) == 0


@pytest.mark.parametrize("bad", [-1, 1.5, "10", True])
def test_a_bad_bound_is_refused_in_one_line(bad: Any) -> None:
    with pytest.raises(InvalidArgument, match="remembered_keys must be a whole number"):
        Client([M1], user="alice", transport=Masters(), remembered_keys=bad)


# -- routing -------------------------------------------------------------------------------


class Masters:
    """Three masters in memory: M1 leads; each has its own view of each key (version,
    creation time, bytes), and refuses a read whose minimum is newer as a real one does."""

    def __init__(self) -> None:
        self.views: dict[str, dict[str, tuple[int, float, bytes]]] = {m: {} for m in (M1, M2, M3)}
        self.behind: set[str] = set()  # masters the leader's writes do not reach
        self.cut_off: set[str] = set()  # masters cut off from ZooKeeper past the bound
        self.calls: list[tuple[str, str, Any]] = []
        self.clock = CREATED

    def _view(self, address: str, key: str, request: Any) -> tuple[int, float, bytes]:
        found = self.views[address].get(key)
        minimum = min_version_from_pb(request)
        if (address in self.cut_off and minimum is None
                and request.view == pb.READ_VIEW_SESSION):
            raise Stale(f"master {address} has been cut off from ZooKeeper for 9 s")
        if address in self.cut_off and request.view == pb.READ_VIEW_LINEARIZABLE:
            raise Unavailable(f"master {address} cannot confirm the latest version")
        if minimum is not None and (found is None or minimum.newer_than(found[0], found[1])):
            if found is None and address not in self.behind:
                raise KeyNotFound(f"no blob with key {key!r}")
            raise Stale(f"master {address}'s view of {key!r} is behind; retry at another")
        if found is None:
            raise KeyNotFound(f"no blob with key {key!r}")
        return found

    def _write(self, key: str, version: int, created_at: float, data: bytes) -> None:
        for m, view in self.views.items():
            if m not in self.behind:
                view[key] = (version, created_at, data)

    def unary(self, address: str, method: str, request: Any, timeout: float | None,
              stall: float | None = None, rivals: Any = ()) -> Any:
        self.calls.append((address, method, _copy(request)))
        if method == "NodeStatus":
            return pb.MasterSummary(address=address, reachable=True,
                                    zookeeper_unreachable=address in self.cut_off)
        if method == "ClusterSummary":
            return pb.ClusterSummaryResponse(
                masters=[pb.MasterSummary(address=m, reachable=True) for m in self.views],
                leader=M1)
        if method in ("Put", "Delete") and address != M1:
            raise NotLeader(f"{address} is not the leader", M1)
        if method == "Put":
            key = request.begin.key
            old = self.views[M1].get(key)
            if request.begin.create:
                self.clock += 1
                version, created_at = 1, self.clock
            else:
                assert old is not None
                version, created_at = old[0] + 1, old[1]
            self._write(key, version, created_at, request.data)
            return self._meta(key, (version, created_at, request.data))
        if method == "Delete":
            for m, view in self.views.items():
                if m not in self.behind:
                    view.pop(request.key, None)
            return pb.DeleteResponse()
        if method == "GetMeta":
            return self._meta(request.key, self._view(address, request.key, request))
        if method == "GetReplication":
            found = self._view(address, request.key, request)
            holders = [m for m, v in self.views.items() if v.get(request.key) == found]
            return pb.ReplicationStatus(key=request.key, version=found[0], holders=holders,
                                        replication=len(holders))
        raise AssertionError(f"unexpected {method}")

    def server_stream(self, address: str, method: str, request: Any, timeout: float | None,
                      stall: float | None = None) -> Iterator[Any]:
        self.calls.append((address, method, _copy(request)))
        version, created_at, data = self._view(address, request.key, request)
        info = pb.BlobInfo(version=version, size=len(data), digest=digest_bytes(data),
                           created_at=created_at)
        return iter([pb.DownloadChunk(info=info, data=data)])

    def _meta(self, key: str, found: tuple[int, float, bytes]) -> pb.BlobMeta:
        version, created_at, data = found
        return pb.BlobMeta(key=key, version=version, size=len(data), created_at=created_at,
                           digest=digest_bytes(data), acknowledged=True, access=7)

    def data_host(self, address: str) -> str | None:
        return None

    def data_tls(self) -> None:
        return None

    def client_stream(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("small blobs only")

    def probe(self, addresses: Sequence[str], method: str, request: Any, timeout: float
              ) -> Iterator[tuple[str, Any]]:
        for address in addresses:
            yield address, self.unary(address, method, request, timeout)

    def close(self) -> None:
        pass

    def refusals(self) -> list[tuple[str, str]]:
        return [(a, m) for a, m, r in self.calls
                if a in self.behind and m != "ClusterSummary" and r.HasField("min_version")]


def _copy(request: Any) -> Any:
    """The request as sent: the client may change its view for the next attempt."""
    sent = type(request)()
    sent.CopyFrom(request)
    return sent


@pytest.fixture
def masters() -> Masters:
    return Masters()


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr(retry_mod, "_monotonic", lambda: now[0])
    return now


@pytest.fixture
def alice(masters: Masters, clock: list[float]) -> Iterator[Client]:
    c = Client([M1, M2, M3], user="alice", timeout=5.0, transport=masters)

    def sleep(secs: float) -> None:
        clock[0] += secs

    c._router.sleep = sleep
    c.cluster_summary()
    with c:
        yield c


def _first_at(client: Client, address: str) -> Client:
    client._router.rng = Steer(address)
    client._router.after_write(address)
    return client


def test_a_write_then_reads_first_sent_to_a_master_behind_get_the_write(
        alice: Client, masters: Masters) -> None:
    alice.create("k", b"one")
    masters.behind.add(M3)
    written = alice.update("k", b"two")
    assert _first_at(alice, M3).get_meta("k").version == written.version == 2
    assert _first_at(alice, M3).read("k") == b"two"
    assert _first_at(alice, M3).get_replication("k").version == 2
    # Each was refused by M3 (with the minimum sent) and answered by another master; the
    # download, refused, asked where the replicas are, M3 first again.
    assert masters.refusals() == [(M3, "GetMeta"), (M3, "Download"), (M3, "GetReplication"),
                                  (M3, "GetReplication")]


def test_a_read_is_monotonic_after_it_saw_a_newer_version(alice: Client,
                                                          masters: Masters) -> None:
    masters._write("k", 4, CREATED, b"four")  # written by someone else
    masters.views[M3]["k"] = (3, CREATED, b"three")
    _first_at(alice, M1).read("k")
    assert _first_at(alice, M3).read("k") == b"four"


def test_a_client_without_a_minimum_is_served_by_any_master(alice: Client,
                                                            masters: Masters) -> None:
    masters._write("k", 4, CREATED, b"four")
    masters.views[M3]["k"] = (3, CREATED, b"three")
    assert _first_at(alice, M3).read("k") == b"three"  # nothing seen: nothing promised


def test_a_deleted_key_is_not_read_back_from_a_master_behind(alice: Client,
                                                             masters: Masters) -> None:
    alice.create("k", b"one")
    masters.behind.add(M3)
    alice.delete("k")
    with pytest.raises(KeyNotFound):
        _first_at(alice, M3).read("k")
    with pytest.raises(KeyNotFound):
        _first_at(alice, M3).get_meta("k")
    assert masters.views[M3]["k"][2] == b"one"  # M3 still had it to give


def test_when_every_master_is_behind_the_read_fails_clearly_and_never_goes_back(
        alice: Client, masters: Masters, clock: list[float]) -> None:
    alice.create("k", b"one")
    masters.behind.update((M2, M3))
    alice.update("k", b"two")
    del masters.views[M1]["k"]  # the one master that had it is gone, say
    masters.behind.add(M1)
    masters.views[M1]["k"] = masters.views[M2]["k"]
    started = clock[0]
    with pytest.raises(Stale, match=r"could not read the metadata of 'k' within 5 s: .*behind"):
        alice.get_meta("k")
    assert clock[0] - started <= 5.0
    with pytest.raises(Stale):
        alice.read("k")


def test_a_memory_of_no_keys_reads_as_before(masters: Masters, clock: list[float]) -> None:
    with Client([M1, M2, M3], user="alice", transport=masters, remembered_keys=0) as c:
        c.create("k", b"one")
        masters.behind.add(M3)
        c.update("k", b"two")
        assert _first_at(c, M3).read("k") == b"one"
        assert not any(r.HasField("min_version") for _, m, r in masters.calls
                       if m in ("GetMeta", "Download", "GetReplication"))


def test_a_version_handed_over_is_read_as_if_this_client_had_read_it(
        alice: Client, masters: Masters) -> None:
    masters._write("k", 4, CREATED, b"four")  # written by another process, which says so
    masters.views[M3]["k"] = (3, CREATED, b"three")
    alice.remember_version("k", 4, CREATED)
    assert _first_at(alice, M3).read("k") == b"four"
    alice.remember_version("k", 2, CREATED)  # an older one handed over later lowers nothing
    assert _first_at(alice, M3).get_meta("k").version == 4
    with pytest.raises(InvalidArgument, match="created_at must be the key's creation time"):
        alice.remember_version("k", 4, 0.0)



# -- views ---------------------------------------------------------------------------------


def _views(masters: Masters, address: str) -> list[tuple[str, int, bool]]:
    """(method, view, carried a minimum) of each read sent to ``address``."""
    return [(m, r.view, r.HasField("min_version")) for a, m, r in masters.calls
            if a == address and m in ("GetMeta", "Download", "GetReplication")]


def test_a_read_with_no_minimum_leaves_a_master_cut_off_too_long(alice: Client,
                                                                 masters: Masters) -> None:
    masters._write("k", 4, CREATED, b"four")
    masters.views[M3]["k"] = (3, CREATED, b"three")
    masters.cut_off.add(M3)
    assert _first_at(alice, M3).read("k") == b"four"
    assert _views(masters, M3) == [("Download", pb.READ_VIEW_SESSION, False)]
    # Refused there, the client asked every master whether it is in touch with ZooKeeper,
    # and read from one that is.
    assert {a for a, m, _ in masters.calls if m == "NodeStatus"} == {M1, M2, M3}


def test_when_every_master_is_cut_off_a_read_takes_the_last_known_view(
        alice: Client, masters: Masters) -> None:
    # A ZooKeeper outage: nothing newer can commit, and each master's last view is served
    # once all of them have said they are cut off.
    masters._write("k", 4, CREATED, b"four")
    masters.cut_off.update((M1, M2, M3))
    assert _first_at(alice, M3).get_meta("k").version == 4
    # Refused by the first master asked, the client found no master in touch with ZooKeeper
    # and asked the same one again for its last known view.
    sent = [(a, r.view) for a, m, r in masters.calls if m == "GetMeta"]
    assert sent == [(M3, pb.READ_VIEW_SESSION), (M3, pb.READ_VIEW_LAST_KNOWN)]
    # Having read v4, the client has a minimum: a master's last view serves it as it is.
    assert _first_at(alice, M2).read("k") == b"four"
    assert _views(masters, M2)[-1] == ("Download", pb.READ_VIEW_SESSION, True)


def test_a_linearizable_client_has_every_read_confirmed(masters: Masters,
                                                        clock: list[float]) -> None:
    with Client([M1, M2, M3], user="alice", transport=masters,
                consistency="linearizable") as c:
        assert c.consistency == "linearizable"
        masters._write("k", 1, CREATED, b"one")
        masters.cut_off.add(M3)  # cannot confirm: the read goes to another master
        assert _first_at(c, M3).read("k") == b"one"
        assert _first_at(c, M3).get_meta("k").version == 1
        c.get_replication("k")
        sent = {v for a in (M1, M2, M3) for _, v, _ in _views(masters, a)}
        assert sent == {pb.READ_VIEW_LINEARIZABLE}
        c.consistency = "session"
        assert _first_at(c, M1).read("k") == b"one"
        assert _views(masters, M1)[-1][1] == pb.READ_VIEW_SESSION
        with pytest.raises(InvalidArgument, match="consistency must be 'session' or"):
            c.consistency = "strong"
