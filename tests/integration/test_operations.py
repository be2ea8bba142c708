"""Operations on a real cluster: /metrics, /status.json, the gRPC health and reflection services,
request ids in trailers and logs, JSON logs, and the leader-change history."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import xxhash
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from support.harness import (
    FAST,
    SESSION_TIMEOUT_MS,
    client_for,
    followers,
    http_get,
    make_cluster,
    md,
    scrape,
    store_dir,
    stub,
    value,
    wait_until,
)

from blobha.client import Client
from blobha.ops.localcluster import LocalCluster, MasterProcess, _free_ports, cpus_allowed
from blobha.v1 import blobha_pb2 as pb
from blobha.wire.peers import CHANNEL_OPTIONS

pytestmark = pytest.mark.integration

REQUEST_ID = "x-request-id"


def status_json(m: MasterProcess) -> dict[str, Any]:
    status, ctype, body = http_get(m.status_url + "status.json")
    assert status == 200 and ctype == "application/json"
    doc: dict[str, Any] = json.loads(body)
    return doc


def test_metrics_count_calls_by_method_and_code_and_bytes(cluster: LocalCluster, alice: Client,
                                                          unique_key: str) -> None:
    leader = cluster.leader()
    before = [scrape(m) for m in cluster.masters]
    data = os.urandom(1_500_000)  # above the one-call Put size: the resumable upload
    alice.create(unique_key, data, replication_factor=3)
    assert alice.read(unique_key) == data
    alice.create(unique_key + "-small", b"small")  # a Put
    with pytest.raises(Exception, match="no blob"):
        alice.get_meta(unique_key + "-missing")
    with grpc.insecure_channel(leader.address) as ch, pytest.raises(grpc.RpcError) as e:
        ch.unary_unary("/blobha.v1.BlobStore/Nope")(b"", timeout=5)
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    # A master counts a data channel transfer once its send returns, which may be after the
    # reader has it all: two syncs and a read.
    channel_before = sum(value(b, "blobha_data_channel_bytes_total") for b in before)
    wait_until(lambda: sum(value(scrape(m), "blobha_data_channel_bytes_total")
                           for m in cluster.masters) - channel_before >= 3 * len(data),
               what="the data channel transfers counted")
    after = [scrape(m) for m in cluster.masters]

    def delta(name: str, **labels: str) -> float:
        return sum(value(a, name, **labels) - value(b, name, **labels)
                   for a, b in zip(after, before, strict=True))

    i = cluster.masters.index(leader)
    assert value(after[i], "grpc_server_handled_total", grpc_method="CommitUpload",
                 grpc_code="OK") - value(before[i], "grpc_server_handled_total",
                                         grpc_method="CommitUpload", grpc_code="OK") >= 1
    assert delta("grpc_server_handled_total", grpc_method="GetMeta", grpc_code="NOT_FOUND") >= 1
    assert value(after[i], "grpc_server_handled_total", grpc_method="Put", grpc_code="OK") - \
        value(before[i], "grpc_server_handled_total", grpc_method="Put", grpc_code="OK") >= 1
    assert delta("grpc_server_started_total", grpc_method="BeginUpload") >= 1
    # Upload bytes arrive at the leader; download bytes leave whichever replicas served them
    # (and the followers' sync fetches): at least the blob's size each way. An upload or a
    # download of more than 1 MiB takes the data channel: only its offer goes through gRPC.
    assert value(after[i], "blobha_data_channel_received_bytes_total") - \
        value(before[i], "blobha_data_channel_received_bytes_total") == len(data)
    assert value(after[i], "blobha_rpc_received_bytes_total", grpc_method="AppendUpload") == \
        value(before[i], "blobha_rpc_received_bytes_total", grpc_method="AppendUpload")
    assert delta("grpc_server_handled_total", grpc_method="GetUploadStatus", grpc_code="OK") >= 1
    assert delta("blobha_data_channel_transfers_total") >= 3
    assert delta("blobha_rpc_sent_bytes_total", grpc_method="Download") > 0
    assert delta("grpc_server_handling_seconds_count", grpc_method="CommitUpload") >= 1
    # A call that is not a known method is not counted (callers cannot invent label values).
    assert not any("grpc_method" in dict(ls) and dict(ls)["grpc_method"] == "Nope"
                   for a in after for (_, ls) in a)


def test_state_metrics_show_leader_zookeeper_blobs_and_under_replication(
    cluster: LocalCluster, alice: Client, unique_key: str,
) -> None:
    alice.create(unique_key, b"abc" * 1000, replication_factor=3)
    # More copies than there are masters: under-replicated for as long as it exists.
    alice.create(unique_key + "-wants-5", b"five", replication_factor=5)
    alice.wait_for_replication([unique_key, unique_key + "-wants-5"], 3, timeout=20)
    leader = cluster.leader()

    def settled() -> list[dict[tuple[str, frozenset[tuple[str, str]]], float]]:
        all_ = [scrape(m) for m in cluster.masters]
        ok = all(value(s, "blobha_under_replicated_blobs") >= 1
                 and value(s, "blobha_sync_lag_blobs") == 0 for s in all_)
        return all_ if ok else []

    samples = wait_until(settled, 20, "every master to see the under-replicated blob")
    leaders = [m for m, s in zip(cluster.masters, samples, strict=True)
               if value(s, "blobha_is_leader") == 1]
    assert leaders == [leader]
    epochs = {value(s, "blobha_leader_epoch") for s in samples}
    assert len(epochs) == 1 and epochs.pop() >= 1
    for m, s in zip(cluster.masters, samples, strict=True):
        assert value(s, "blobha_zookeeper_session_state", state="CONNECTED") == 1
        assert value(s, "blobha_zookeeper_session_state", state="SUSPENDED") == 0
        assert value(s, "blobha_blobs_stored") >= 2
        assert value(s, "blobha_stored_bytes") >= 3000
        # Both blobs are small: records of a segment on every master.
        assert value(s, "blobha_segment_files") >= 1
        assert value(s, "blobha_segment_bytes") >= value(s, "blobha_segment_live_bytes") >= 3000
        assert value(s, "blobha_cluster_blobs") >= 2
        assert value(s, "blobha_disk_free_bytes") > 0
        assert ("blobha_sync_queue_depth", frozenset()) in s
        assert ("blobha_view_keys_behind", frozenset()) in s
        assert value(s, "blobha_build_info", address=m.address) == 1
        assert value(s, "blobha_uptime_seconds") > 0
        # The scrubber's counters: its first pass runs at start; nothing here is corrupt.
        assert ("blobha_scrub_passes_total", frozenset()) in s
        assert value(s, "blobha_scrub_corrupt_found_total") == 0
        assert ("blobha_scrub_bytes_verified_total", frozenset()) in s


def test_status_json_shows_masters_leader_blobs_and_terms(
    cluster: LocalCluster, alice: Client, unique_key: str,
) -> None:
    alice.create(unique_key, b"z" * 5000, replication_factor=3)
    alice.wait_for_replication([unique_key], 3, timeout=20)
    leader = cluster.leader()
    for m in cluster.masters:
        doc = wait_until(
            lambda m=m: (d := status_json(m)) and any(
                b["key"] == unique_key and b["replication"] == 3 for b in d["blobs"]) and d,
            15, f"{m.address} to show {unique_key} with 3 replicas",
        )
        assert doc["this_master"] == m.address
        assert doc["leader"] == leader.address
        assert doc["errors"] == []
        assert {x["address"] for x in doc["masters"]} == {x.address for x in cluster.masters}
        assert {x["address"]: x["status_url"] for x in doc["masters"]} == {
            x.address: x.status_url for x in cluster.masters}
        row = next(x for x in doc["masters"] if x["address"] == leader.address)
        assert row["is_leader"] and row["reachable"] and row["uptime_secs"] > 0
        assert row["disk_free"] > 0 and row["version"]
        blob = next(b for b in doc["blobs"] if b["key"] == unique_key)
        assert blob == {**blob, "version": 1, "size": 5000, "replication": 3,
                        "replication_factor": 3, "target": 3, "under_replicated": False}
        assert sorted(blob["holders"]) == sorted(x.address for x in cluster.masters)
        assert doc["failovers"][0]["leader"] == leader.address
        assert doc["failovers"][0]["epoch"] == doc["epoch"]
    # Under-replicated blobs come first.
    alice.create(unique_key + "-wants-4", b"four", replication_factor=4)
    doc = wait_until(lambda: (d := status_json(cluster.masters[0])) and any(
        b["key"] == unique_key + "-wants-4" for b in d["blobs"]) and d, 15, "the rf-4 blob")
    flags = [b["under_replicated"] for b in doc["blobs"]]
    assert flags == sorted(flags, reverse=True) and flags[0]
    assert doc["under_replicated"] == sum(flags)


def test_http_endpoints_serve_the_page_and_refuse_bad_requests(cluster: LocalCluster) -> None:
    m = cluster.masters[0]
    status, ctype, body = http_get(m.status_url)
    assert status == 200 and ctype.startswith("text/html") and b"status.js" in body
    status, ctype, body = http_get(m.status_url + "status.js")
    assert status == 200 and ctype.startswith("text/javascript") and b"status.json" in body
    assert http_get(m.status_url + "status.css")[0] == 200
    status, _, body = http_get(m.status_url + "nope")
    assert status == 404 and b"/status.json" in body
    status, _, body = http_get(m.status_url + "status.json?limit=abc")
    assert status == 400 and b"limit" in body
    doc = json.loads(http_get(m.status_url + "status.json?limit=1")[2])
    assert len(doc["blobs"]) <= 1


def test_health_service_reports_serving_for_the_master_and_the_blob_service(
    cluster: LocalCluster,
) -> None:
    for m in cluster.masters:
        with grpc.insecure_channel(m.address, options=CHANNEL_OPTIONS) as ch:
            h = health_pb2_grpc.HealthStub(ch)
            for service in ("", "blobha.v1.BlobStore"):
                reply = h.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as e:
                h.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            # Watch streams (kept out of the per-call interceptor) answer at once.
            watch = h.Watch(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            watch.cancel()


def test_reflection_lists_and_describes_services_like_grpcurl(cluster: LocalCluster) -> None:
    with grpc.insecure_channel(cluster.masters[0].address, options=CHANNEL_OPTIONS) as ch:
        db = ProtoReflectionDescriptorDatabase(ch)
        services = set(db.get_services())
        assert {"blobha.v1.BlobStore", "grpc.health.v1.Health",
                "grpc.reflection.v1alpha.ServerReflection"} <= services
        pool = descriptor_pool.DescriptorPool(db)
        svc = pool.FindServiceByName("blobha.v1.BlobStore")
        methods = {m.name for m in svc.methods}
        assert {"BeginUpload", "AppendUpload", "Download", "ClusterSummary"} <= methods
        begin = pool.FindMessageTypeByName("blobha.v1.BeginUploadRequest")
        assert {f.name for f in begin.fields} >= {"key", "acl", "replication_factor"}


def test_request_id_comes_back_in_trailers_and_appears_in_the_log(
    cluster: LocalCluster, unique_key: str,
) -> None:
    leader = cluster.leader()
    s = stub(leader.address)
    _, call = s.ClusterSummary.with_call(pb.ClusterSummaryRequest(), timeout=10,
                                         metadata=(*md("alice"), (REQUEST_ID, "ops-test-ok-1")))
    assert (REQUEST_ID, "ops-test-ok-1") in tuple(call.trailing_metadata())
    # Without one, the master makes one up and still returns it.
    _, call = s.ClusterSummary.with_call(pb.ClusterSummaryRequest(), timeout=10,
                                         metadata=md("alice"))
    assert dict(call.trailing_metadata())[REQUEST_ID]
    # An unusable id (here with spaces) is replaced, not refused.
    _, call = s.ClusterSummary.with_call(pb.ClusterSummaryRequest(), timeout=10,
                                         metadata=(*md("alice"), (REQUEST_ID, "a b")))
    assert dict(call.trailing_metadata())[REQUEST_ID] not in ("", "a b")

    # On errors too, next to the handler's own trailers (the leader's address on a redirect).
    follower = followers(cluster)[0]
    rid = f"ops-redirect-{os.getpid()}"
    with pytest.raises(grpc.RpcError) as e:
        stub(follower.address).BeginUpload(
            pb.BeginUploadRequest(key=unique_key, create=True, size_hint=-1), timeout=10,
            metadata=(*md("alice"), (REQUEST_ID, rid)))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    trailers = dict(e.value.trailing_metadata())
    assert trailers[REQUEST_ID] == rid
    assert trailers["x-blobha-leader"] == leader.address
    # Failed calls are logged with their id, so an operator can find the call.
    wait_until(lambda: any(rid in line and "FAILED_PRECONDITION" in line
                           for line in follower.log_path.read_text().splitlines()),
               10, "the refused call in the follower's log")


def test_json_logs_carry_the_request_id(tmp_path: Path) -> None:
    c = make_cluster(tmp_path / "c", nodes=1, **{"log.format": "json"})
    try:
        c.start()
        m = c.masters[0]
        with pytest.raises(grpc.RpcError) as e:
            stub(m.address).GetMeta(pb.GetMetaRequest(key="absent"), timeout=10,
                                    metadata=(*md("alice"), (REQUEST_ID, "json-log-1")))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND

        def records() -> list[dict[str, Any]]:
            return [json.loads(line) for line in m.log_path.read_text().splitlines()
                    if line.startswith("{")]

        hit = wait_until(lambda: [r for r in records() if r["request_id"] == "json-log-1"],
                         10, "a JSON log record with the request id")
        assert hit[0]["level"] == "INFO" and "NOT_FOUND" in hit[0]["message"]
        assert hit[0]["master"] == m.address and hit[0]["logger"] and hit[0]["ts"]
        recs = records()
        assert any(r["message"].startswith("master ") and "serving" in r["message"] for r in recs)
        assert {r["request_id"] for r in recs if "serving" in r["message"]} == {"-"}
        # Every line the master wrote is JSON (nothing else writes to its log).
        lines = [x for x in m.log_path.read_text().splitlines() if x.strip()]
        assert all(x.startswith("{") for x in lines), [x for x in lines if not x.startswith("{")]
    finally:
        c.stop()


def test_leader_changes_reach_history_metrics_and_health(fresh_cluster: LocalCluster) -> None:
    old = fresh_cluster.leader()
    survivor = next(m for m in fresh_cluster.masters if m is not old)
    start_epoch = status_json(survivor)["epoch"]
    old.kill()

    def new_term() -> dict[str, Any]:
        d = status_json(survivor)
        return d if d["leader"] and d["leader"] != old.address and len(d["failovers"]) >= 2 \
            else {}

    doc = wait_until(new_term, SESSION_TIMEOUT_MS / 1000 + 15, "a new leader on the page")
    newest, previous = doc["failovers"][0], doc["failovers"][1]
    assert newest["leader"] == doc["leader"] and newest["epoch"] > start_epoch
    assert not newest["at_start"]
    assert previous["leader"] == old.address and previous["epoch"] == start_epoch
    assert doc["leader_changes"] >= 1
    assert value(scrape(survivor), "blobha_leader_changes_total") >= 1
    dead = next(x for x in doc["masters"] if x["address"] == old.address) \
        if any(x["address"] == old.address for x in doc["masters"]) else None
    assert dead is None or not dead["reachable"]

    # ZooKeeper down: masters report NOT_SERVING (and the page still answers); back: SERVING.
    def health(m: MasterProcess) -> int:
        with grpc.insecure_channel(m.address, options=CHANNEL_OPTIONS) as ch:
            return int(health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=3).status)

    fresh_cluster.zk.stop()
    try:
        wait_until(lambda: health(survivor) == health_pb2.HealthCheckResponse.NOT_SERVING,
                   15, "NOT_SERVING while ZooKeeper is down")
        down = status_json(survivor)
        assert down["zookeeper"]["state"] != "CONNECTED"
        assert any("ZooKeeper is unreachable" in e for e in down["errors"]), down["errors"]
        assert value(scrape(survivor), "blobha_zookeeper_session_state", state="CONNECTED") == 0
    finally:
        fresh_cluster.zk.start()
    wait_until(lambda: health(survivor) == health_pb2.HealthCheckResponse.SERVING,
               30, "SERVING once ZooKeeper is back")
    with client_for(fresh_cluster) as c:
        c.create("after-outage", b"ok")


def _serve(config: Path) -> subprocess.CompletedProcess[str]:
    """``blobha serve`` run to its end (it is expected to refuse to start)."""
    return subprocess.run([sys.executable, "-m", "blobha", "serve", "--config", str(config)],
                          capture_output=True, text=True, timeout=60, cwd=config.parent)


@pytest.fixture
def patient_cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    """A cluster whose idle uploads last: a test that holds one open across two refused
    'blobha serve' runs (seconds each on a loaded machine) would see it expire at FAST's 3 s."""
    lc = make_cluster(tmp_path / "patient", **{"blobstore.upload.expiration.secs": 600})
    lc.start()
    try:
        lc.wait_ready(60)
        yield lc
    finally:
        lc.stop()


def test_a_second_master_on_a_running_masters_directory_or_address_refuses_to_start(
        patient_cluster: LocalCluster, unique_key: str, tmp_path: Path) -> None:
    cluster = patient_cluster
    leader = cluster.leader()
    s = stub(leader.address)
    begun = s.BeginUpload(pb.BeginUploadRequest(key=unique_key, create=True,
                                                replication_factor=1), metadata=md("alice"))
    first, rest = b"before the second master", b" and after it"
    s.AppendUpload(iter([pb.UploadChunk(upload_id=begun.upload_id, offset=0, data=first)]),
                   metadata=md("alice"))
    temp_files = set((store_dir(leader) / "tmp").iterdir())
    assert temp_files

    # The same configuration again (a unit started twice): refused before it touches anything.
    twice = _serve(leader.config_path)
    assert twice.returncode == 1, twice.stdout + twice.stderr
    out = twice.stdout + twice.stderr
    assert f"in use by another blobha master (pid {leader.pid})" in out
    assert "Traceback" not in out
    assert set((store_dir(leader) / "tmp").iterdir()) == temp_files

    # Its own directory but the running master's address: refused at the bind.
    config = _config_beside(leader, tmp_path / "copy.toml",
                            **{"blobstore.dir": str(tmp_path / "data")})
    same_address = _serve(config)
    assert same_address.returncode == 1, same_address.stdout + same_address.stderr
    out = same_address.stdout + same_address.stderr
    assert f"cannot listen on master.listen {leader.address}" in out
    assert "Traceback" not in out

    # The running master lost nothing: its upload goes on and commits.
    s.AppendUpload(iter([pb.UploadChunk(upload_id=begun.upload_id, offset=len(first),
                                        data=rest)]), metadata=md("alice"))
    data = first + rest
    s.CommitUpload(pb.CommitUploadRequest(upload_id=begun.upload_id, size=len(data),
                                          digest=xxhash.xxh3_128_hexdigest(data)),
                   metadata=md("alice"), timeout=30)
    with client_for(cluster) as c:
        assert c.read(unique_key) == data


def test_a_local_master_whose_free_port_was_taken_meanwhile_starts_on_another(
        tmp_path: Path) -> None:
    # Ports picked free are only free until someone binds them (CI once lost a Spark test
    # module to this); a first start with picked ports moves the master rather than failing.
    lc = LocalCluster(tmp_path / "cluster", nodes=3, base_port=0, overrides=FAST)
    unlucky = lc.masters[1]
    taken = unlucky.address
    host, port = taken.rsplit(":", 1)
    with socket.socket() as squatter:
        squatter.bind((host, int(port)))
        squatter.listen()
        try:
            lc.start()
            assert unlucky.address != taken
            assert f"cannot listen on master.listen {taken}" in unlucky.log_path.read_text()
            summary = lc.wait_ready(30)
            assert sorted(m.address for m in summary.masters if m.reachable) == sorted(
                m.address for m in lc.masters)
            with client_for(lc) as c:
                c.create("moved", b"still one cluster", replication_factor=3)
                assert c.wait_for_replication(["moved"], 3, timeout=30).reached
        finally:
            lc.stop()


def test_ports_picked_for_a_local_cluster_avoid_the_ephemeral_range() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    if low <= 10000 + 64:
        pytest.skip(f"the ephemeral range starts at {low}, leaving no room below it")
    ports = _free_ports(6)
    assert len(set(ports)) == 6
    assert all(10000 <= p < low for p in ports), ports


def _config_beside(m: MasterProcess, path: Path, **values: object) -> Path:
    """``m``'s configuration with ``values`` in place of its own, and no status page."""
    drop = ('"metrics.listen"', *(json.dumps(k) for k in values))
    lines = [line for line in m.config_path.read_text().splitlines()
             if not line.startswith(drop)]
    path.write_text("\n".join([*lines, *(f"{json.dumps(k)} = {json.dumps(v)}"
                                          for k, v in values.items())]) + "\n")
    return path


def test_a_master_advertising_a_running_masters_address_refuses_to_start(
        cluster: LocalCluster, unique_key: str, tmp_path: Path) -> None:
    running = followers(cluster)[0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = _config_beside(running, tmp_path / "twin.toml", **{
        "blobstore.dir": str(tmp_path / "data"), "master.listen": f"127.0.0.1:{port}",
        "master.advertise": running.address,
        # The wait for the name to be released is twice the session timeout and 2 s.
        "zookeeper.session.timeout.ms": 1000,
    })
    twin = _serve(config)
    out = twin.stdout + twin.stderr
    assert twin.returncode == 1, out
    assert (f"another master (pid {running.pid} on {socket.gethostname()}) is registered as"
            f" {running.address}") in out
    assert "did not go away within 4 s" in out and "master.advertise" in out
    assert "Traceback" not in out
    # The running master kept its name: it still takes new replicas, and is listed.
    with client_for(cluster) as c:
        c.create(unique_key, b"after the twin", replication_factor=3)
        result = c.wait_for_replication([unique_key], 3, timeout=30)
        assert result.reached and running.address in result.statuses[0].holders
        masters = {m.address for m in c.cluster_summary().masters if m.reachable}
        assert running.address in masters


#: Long enough that a restarted master that waited for its predecessor's session to expire
#: would miss the deadlines below by far (the embedded ZooKeeper allows up to 60 s).
_LONG_SESSION_MS = 40_000


def _recorded_session(lc: LocalCluster, m: MasterProcess) -> int:
    """The ZooKeeper session ``m`` recorded in its data directory."""
    record = lc.data_dir / f"master-{m.index + 1}" / "zk-session"
    return int(json.loads(record.read_text())["session"])


def test_a_follower_killed_and_restarted_at_once_ends_its_old_session(tmp_path: Path) -> None:
    with make_cluster(tmp_path / "cluster", **{"zookeeper.session.timeout.ms": _LONG_SESSION_MS}
                      ) as lc, client_for(lc) as c:
        c.create("before", b"one", replication_factor=3)
        assert c.wait_for_replication(["before"], 3, timeout=30).reached
        m = followers(lc)[0]
        old_session = _recorded_session(lc, m)
        m.kill()
        lc.start_master(m)
        # Its old session would hold its name for 40 s more; the restarted process ends it (it
        # holds the data directory, so the process that recorded it is gone) and registers.
        c.create("after", b"two", replication_factor=3)
        result = c.wait_for_replication(["before", "after"], 3, timeout=15)
        assert result.reached, result
        assert all(m.address in s.holders for s in result.statuses)
        log_text = m.log_path.read_text(errors="replace")
        assert f"ended ZooKeeper session 0x{old_session:x}" in log_text
        assert "for it to expire" not in log_text
        assert _recorded_session(lc, m) != old_session


def test_a_leader_killed_and_restarted_at_once_hands_over_at_once(tmp_path: Path) -> None:
    # With ZooKeeper locked down: the old session is resumed with the masters' credentials.
    with LocalCluster(tmp_path / "cluster", nodes=3, base_port=0, zk_lockdown=True,
                      overrides={**FAST, "zookeeper.session.timeout.ms": _LONG_SESSION_MS}
                      ) as lc, client_for(lc, timeout=20) as c:
        c.create("before", b"one", replication_factor=3)
        assert c.wait_for_replication(["before"], 3, timeout=30).reached
        old = lc.leader()
        old_session = _recorded_session(lc, old)
        old.kill()
        lc.start_master(old)
        # No master may lead while the dead leader's candidacy lives on (40 s); ending its
        # session removes it, so this write finds a leader within the client's 20 s.
        c.create("after", b"two", replication_factor=3)
        assert c.read("before") == b"one"
        assert c.wait_for_replication(["after"], 3, timeout=15).reached
        log_text = old.log_path.read_text(errors="replace")
        ended = log_text.find(f"ended ZooKeeper session 0x{old_session:x}")
        # Ended before its store loaded (the last opening in the log is the restarted one's):
        # a load that grows with the keys never delays the hand-over.
        assert 0 <= ended < log_text.rindex(" open in "), log_text[-3000:]


def _task_cpu_lists(pid: int) -> set[str]:
    """The CPU lists of every thread of process ``pid``: a mask is per thread."""
    tasks = Path(f"/proc/{pid}/task")
    # A task's entry reads as a process's; "?" is a thread that ended meanwhile.
    return {cpus_allowed(int(t.name), tasks) for t in tasks.iterdir()} - {"?"}


def test_a_local_clusters_masters_each_run_on_one_cpu_and_serve(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    monkeypatch.delenv("BLOBHA_MASTER_CPUS", raising=False)  # the masters would inherit it
    lc = LocalCluster(tmp_path / "cluster", nodes=3, base_port=0, overrides=FAST,
                      spread_cpus=True)
    try:
        lc.start()
        lc.wait_ready(60)
        for m in lc.masters:
            if len(allowed) < 2:
                # One CPU: nothing to spread, and the masters keep what they were given.
                assert _task_cpu_lists(m.pid) == _task_cpu_lists(os.getpid())
                continue
            cpu = str(allowed[m.index % len(allowed)])
            # Every thread, the ones started after the confinement too (gRPC, kazoo, sync).
            assert _task_cpu_lists(m.pid) == {cpu}, (m.index, cpu)
            assert f"running on CPU {cpu} (master.cpus)" in m.log_since_start()
        if len(allowed) >= 2:
            spread = {_task_cpu_lists(m.pid).pop() for m in lc.masters}
            assert len(spread) == min(3, len(allowed)), spread
        # Confined, they still do their work: a write replicated to all three and read back.
        with client_for(lc) as c:
            c.create("pinned", b"on one cpu each", replication_factor=3)
            assert c.wait_for_replication(["pinned"], 3, 30).reached
            assert c.read("pinned") == b"on one cpu each"
    finally:
        lc.stop()


def test_a_master_given_cpus_it_may_not_use_refuses_to_start_and_touches_nothing(
        tmp_path: Path) -> None:
    beyond = max(os.sched_getaffinity(0)) + 1
    data = tmp_path / "data"
    config = tmp_path / "master.toml"
    with socket.socket() as s:  # a port with no ZooKeeper: it must not get that far
        s.bind(("127.0.0.1", 0))
        nothing = s.getsockname()[1]
    config.write_text(
        f'"blobstore.dir" = "{data}"\n'
        f'"zookeeper.servers" = "127.0.0.1:{nothing}"\n'
        f'"master.listen" = "127.0.0.1:{_free_ports(1)[0]}"\n'
        f'"master.cpus" = "0,{beyond}"\n')
    refused = _serve(config)
    out = refused.stdout + refused.stderr
    assert refused.returncode == 1, out
    assert f"names CPU {beyond}, which this master may not use" in out, out
    assert "Traceback" not in out
    assert not data.exists()

    # A list that is no list is a configuration error, named as such.
    config.write_text(config.read_text().replace(f'"0,{beyond}"', '"first"'))
    bad = _serve(config)
    assert bad.returncode == 2, bad.stdout + bad.stderr
    assert "master.cpus must be a CPU list" in bad.stdout + bad.stderr
    assert not data.exists()


def test_reads_and_writes_start_no_thread_per_call(alice: Client, unique_key: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # gRPC reads a server stream (a download) on a channel thread of its own, started again
    # for each call made while no other runs, and a unary call made with a future answers
    # through the same thread: each such call cost the client a thread start and a wake-up
    # (about 0.2 ms of CPU per 4 KiB read or create). The client reads on the caller's thread.
    data = os.urandom(4096)
    alice.create(unique_key, data, replication_factor=3)
    assert alice.read(unique_key) == data  # the channels and the call watch exist from here
    started: list[str] = []
    start = threading.Thread.start

    def counted(self: threading.Thread) -> None:
        started.append(self.name)
        start(self)

    monkeypatch.setattr(threading.Thread, "start", counted)
    for i in range(10):
        assert alice.read(unique_key) == data
        alice.create(f"{unique_key}-{i}", data)
    assert started == []
