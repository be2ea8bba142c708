"""``blobha spark-submit`` (blobha.spark.submit_main) and wait_for_replication against a real
3-master cluster: fail fast on forbidden or missing blobs, wait then fail under the ``fail``
policy, wait then go ahead with a warning under the default one, and hand spark-submit a
configuration that executors can read.

The command run after the wait is a stand-in spark-submit that records what it was given: what
is tested here is the launcher's decision and the configuration it passes. A real
spark-submit runs in test_spark_example.py.
"""

from __future__ import annotations

import itertools
import json
import stat
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.clusters import running_cluster

from blobha import spark as blobspark
from blobha.client import BlobMeta, Client, ClusterSummary, WaitResult
from blobha.ops.localcluster import LocalCluster
from blobha.spark import driver as spark_driver

pytestmark = pytest.mark.spark

PUBLIC = "launch-public"
SECRET = "launch-secret"
WRITABLE = "launch-writable"  # bob may write it, and change its ACL, but not read it
ARCHIVE = "launch-libs.tgz"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with running_cluster(tmp_path_factory.mktemp("cluster")) as c:
        with Client(c.cluster, user="alice", timeout=60) as alice:
            alice.create(PUBLIC, b"p" * 4096, acl="o::r", replication_factor=3)
            alice.create(ARCHIVE, b"not really an archive", acl="o::r", replication_factor=3)
            alice.create(SECRET, b"s" * 4096, acl="u:alice:rwa", replication_factor=3)
            alice.create(WRITABLE, b"w" * 4096, acl="u:alice:rwa,u:bob:-wa",
                         replication_factor=3)
            alice.wait_for_replication([PUBLIC, ARCHIVE, SECRET, WRITABLE], 3, 30)
        yield c


@pytest.fixture
def fake_submit(tmp_path: Path) -> tuple[Path, Path]:
    """A spark-submit stand-in recording its arguments and environment."""
    record = tmp_path / "submitted.json"
    script = tmp_path / "spark-submit"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        f"out = open({str(record)!r}, 'w')\n"
        "json.dump({'argv': sys.argv[1:], 'env': dict(os.environ)}, out)\n"
        "sys.exit(int(os.environ.get('FAKE_SUBMIT_STATUS', '0')))\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script, record


def _confs(argv: list[str]) -> dict[str, str]:
    out = {}
    for flag, value in itertools.pairwise(argv):
        if flag == "--conf":
            key, _, v = value.partition("=")
            out[key] = v
    return out


def test_fail_policy_waits_then_refuses_to_launch(
    cluster: LocalCluster, fake_submit: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    script, record = fake_submit
    caplog.set_level("INFO", logger="blobha.spark")
    started = time.monotonic()
    status = blobspark.submit_main([
        "--blob", PUBLIC, "--min-replication", "4", "--max-wait", "2", "--on-timeout", "fail",
        "--cluster", cluster.cluster, "--user", "bob", "--spark-submit", str(script),
        "--", "--master", "local[1]", "job.py",
    ])
    elapsed = time.monotonic() - started
    assert status == 12  # DeadlineExceeded
    assert elapsed >= 2.0, "it must wait the whole max wait before giving up"
    assert not record.exists(), "spark-submit must not run"
    assert "waiting up to 2 s for 1 blob(s) to reach 4 replica(s)" in caplog.text
    assert "factor 3 < 4" in caplog.text  # the warning that the wait cannot succeed
    assert f"{PUBLIC} has 3" in caplog.text and "fail" in caplog.text


def test_default_policy_waits_then_launches_with_a_warning(
    cluster: LocalCluster, fake_submit: tuple[Path, Path], caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:
    script, record = fake_submit
    caplog.set_level("INFO", logger="blobha.spark")
    started = time.monotonic()
    status = blobspark.submit_main([
        "--blob", f"{PUBLIC}:public.bin", "--blob", f"{ARCHIVE}:libs:uncompress",
        "--min-replication", "4", "--max-wait", "2",
        "--cluster", cluster.cluster, "--user", "bob", "--cache-dir", str(tmp_path / "c"),
        "--update-interval", "5", "--spark-submit", str(script),
        "--", "--master", "local[1]", "--conf", "spark.blobha.client.timeout.secs=33",
        "--name", "x", "job.py", "--conf", "app-arg=untouched",
    ])
    assert status == 0
    assert time.monotonic() - started >= 2.0
    assert any(
        r.levelname == "WARNING" and "launching anyway" in r.getMessage() for r in caplog.records
    )
    submitted = json.loads(record.read_text())
    argv = submitted["argv"]
    # The user's options follow the launcher's; the application's own arguments (even one
    # spelled --conf) come last, untouched.
    assert argv[-5:] == ["--name", "x", "job.py", "--conf", "app-arg=untouched"]
    # The user's spark.blobha.* --conf is folded into the launcher's, given once.
    assert argv.count("spark.blobha.client.timeout.secs=33") == 1
    confs = _confs(argv[: argv.index("job.py")])
    assert json.loads(confs[blobspark.CONF_MAP]) == {
        PUBLIC: {"localname": "public.bin", "uncompress": False},
        ARCHIVE: {"localname": "libs", "uncompress": True},
    }
    assert confs[blobspark.CONF_CLUSTER] == cluster.cluster
    assert confs[blobspark.CONF_USER] == "bob"
    # The executors' carrier holds the same settings, the --conf given after '--' included.
    carried = blobspark.SparkBlobSettings.from_json(
        confs[f"spark.executorEnv.{blobspark.ENV_CONF}"]
    )
    assert carried.user == "bob" and carried.cluster == cluster.cluster
    assert carried.cache_dir == str(tmp_path / "c")
    assert carried.update_interval_secs == 5.0
    assert carried.client_timeout_secs == 33.0
    assert carried.spec("libs").uncompress
    # And the version of each blob the launcher saw, which every read of the job reaches.
    with Client(cluster.cluster, user="bob", timeout=30) as bob:
        for key in (PUBLIC, ARCHIVE):
            meta = bob.get_meta(key)
            assert carried.min_version(key) == (key, meta.version, meta.created_at)
    assert confs[blobspark.CONF_PREFIX + "min.versions"] == carried.to_conf()[
        blobspark.CONF_PREFIX + "min.versions"]
    assert submitted["env"]["PYSPARK_PYTHON"]  # workers get an interpreter with blobha


def test_spark_submit_status_is_returned(
    cluster: LocalCluster, fake_submit: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    script, _ = fake_submit
    monkeypatch.setenv("FAKE_SUBMIT_STATUS", "7")
    status = blobspark.submit_main([
        "--blob", PUBLIC, "--min-replication", "3", "--cluster", cluster.cluster,
        "--spark-submit", str(script), "--", "job.py",
    ])
    assert status == 7


def test_forbidden_and_missing_blobs_fail_fast(
    cluster: LocalCluster, fake_submit: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    script, record = fake_submit
    started = time.monotonic()
    status = blobspark.submit_main([
        "--blob", PUBLIC, "--blob", SECRET, "--blob", "launch-no-such-key",
        "--min-replication", "3", "--max-wait", "60",
        "--cluster", cluster.cluster, "--user", "bob", "--spark-submit", str(script),
        "--", "job.py",
    ])
    assert status == 5  # NotAuthorized: something is forbidden
    assert time.monotonic() - started < 30, "no waiting for blobs that cannot be used"
    assert not record.exists()
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1
    assert f"forbidden (user 'bob' lacks READ): {SECRET}" in errors[0]
    assert "missing: launch-no-such-key" in errors[0]
    assert PUBLIC not in errors[0]


def test_wait_for_replication_report(cluster: LocalCluster) -> None:
    report = blobspark.wait_for_replication(
        [PUBLIC, ARCHIVE], 3, 30, cluster=cluster.cluster, user="bob"
    )
    assert report.reached and report.user == "bob" and report.under_replicated == ()
    assert {s.key: s.replication for s in report.statuses} == {PUBLIC: 3, ARCHIVE: 3}
    assert 0 <= report.waited_secs < 30

    with pytest.raises(blobspark.ReplicationTimeout) as caught:
        blobspark.wait_for_replication(
            [PUBLIC], 4, 1, cluster=cluster.cluster, user="bob", on_timeout="fail"
        )
    timed_out = caught.value.report
    assert not timed_out.reached and timed_out.waited_secs >= 1
    assert [s.key for s in timed_out.under_replicated] == [PUBLIC]
    assert timed_out.warnings and "cannot be reached" in timed_out.warnings[0]

    with pytest.raises(blobspark.BlobsNotAccessible) as denied:
        blobspark.wait_for_replication([SECRET], 1, 30, cluster=cluster.cluster, user="bob")
    assert denied.value.forbidden == (SECRET,) and denied.value.missing == ()
    # Masters show bob the metadata of a key he may write: that is not leave to read it.
    with pytest.raises(blobspark.BlobsNotAccessible) as denied:
        blobspark.wait_for_replication([WRITABLE, PUBLIC], 1, 30, cluster=cluster.cluster,
                                       user="bob")
    assert denied.value.forbidden == (WRITABLE,) and denied.value.missing == ()


class _CountingClient(Client):
    """A real client that notes which of the pre-launch calls it made."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[str] = []

    def get_meta(self, key: str) -> BlobMeta:
        self.calls.append("get_meta")
        return super().get_meta(key)

    def cluster_summary(self) -> ClusterSummary:
        self.calls.append("cluster_summary")
        return super().cluster_summary()

    def wait_for_replication(self, keys: str | Iterable[str], min_replication: int,
                             timeout: float) -> WaitResult:
        self.calls.append(f"wait {timeout:g}")
        return super().wait_for_replication(keys, min_replication, timeout)


def test_a_launch_whose_blobs_are_replicated_reads_their_metadata_then_waits_once(
        cluster: LocalCluster) -> None:
    with _CountingClient(cluster.cluster, user="bob", timeout=30) as bob:
        report = blobspark.wait_for_replication([PUBLIC, ARCHIVE], 3, 30, client=bob)
        assert report.reached and report.warnings == ()
        assert {s.key: s.replication for s in report.statuses} == {PUBLIC: 3, ARCHIVE: 3}
        # The metadata (asked together) says when each key was created, which the executors
        # need to read at least the version seen here; one wait says both are replicated.
        assert bob.calls == ["get_meta", "get_meta", "wait 0"]
        versions = {s.key: s.version for s in report.statuses}
        assert {m.key: m.version for m in report.seen} == versions
        assert all(m.created_at == bob.get_meta(m.key).created_at for m in report.seen)

        # Short of the minimum: the warnings, then the real wait.
        bob.calls.clear()
        report = blobspark.wait_for_replication([PUBLIC], 4, 1, client=bob)
        assert not report.reached and "cannot be reached" in report.warnings[0]
        assert bob.calls == ["get_meta", "wait 0", "cluster_summary", "wait 1"]

        # Refused: every forbidden and missing key is named, not only the first one.
        bob.calls.clear()
        with pytest.raises(blobspark.BlobsNotAccessible) as denied:
            blobspark.wait_for_replication([SECRET, "launch-no-such-key", PUBLIC], 1, 30,
                                           client=bob)
        assert denied.value.forbidden == (SECRET,)
        assert denied.value.missing == ("launch-no-such-key",)
        assert bob.calls == ["get_meta"] * 3, "refused before any wait"


def test_dry_run_prints_the_command(
    cluster: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    status = blobspark.submit_main([
        "--blob", PUBLIC, "--cluster", cluster.cluster, "--user", "bob",
        "--spark-submit", "/opt/spark/bin/spark-submit", "--dry-run",
        "--", "--master", "yarn", "job.py",
    ])
    out = capsys.readouterr().out
    assert status == 0
    assert out.startswith("/opt/spark/bin/spark-submit --conf ")
    assert "spark.executorEnv.BLOBHA_SPARK_CONF=" in out and out.rstrip().endswith("job.py")


def test_a_token_names_the_user_when_none_is_given(
    cluster: LocalCluster, capsys: pytest.CaptureFixture[str], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The launcher named the user after SPARK_USER or the OS user, and the client then
    # refused the token as another user's ("the token belongs to 'alice', not 'root'"), where
    # 'blobha list' with the same environment worked.
    from blobha.core.auth import new_token

    token_file = tmp_path / "alice.token"
    token_file.write_text(new_token("alice") + "\n")
    token_file.chmod(0o600)  # the client refuses a token file other accounts can read
    monkeypatch.setenv("BLOBHA_TOKEN_FILE", str(token_file))
    monkeypatch.delenv("BLOBHA_USER", raising=False)
    monkeypatch.setenv("SPARK_USER", "someone-else")
    status = blobspark.submit_main([
        "--blob", PUBLIC, "--cluster", cluster.cluster,
        "--spark-submit", "/opt/spark/bin/spark-submit", "--dry-run", "--", "job.py",
    ])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert "--conf spark.blobha.user=alice " in captured.out


def test_the_driver_side_prepare_names_the_user_the_same_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # prepare() (a job set up in code) took BLOBHA_USER, then Spark's user, and skipped the
    # token: a driver with alice's token ran as the OS user and the client refused the token.
    from blobha.core.auth import new_token

    monkeypatch.delenv("BLOBHA_USER", raising=False)
    monkeypatch.delenv("BLOBHA_TOKEN_FILE", raising=False)
    assert spark_driver.job_user(lambda: "spark-user") == "spark-user"
    token_file = tmp_path / "alice.token"
    token_file.write_text(new_token("alice") + "\n")
    token_file.chmod(0o600)  # the client refuses a token file other accounts can read
    monkeypatch.setenv("BLOBHA_TOKEN_FILE", str(token_file))
    assert spark_driver.job_user(lambda: "spark-user") == "alice"
    monkeypatch.setenv("BLOBHA_USER", "bob")
    assert spark_driver.job_user(lambda: "spark-user") == "bob"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--min-replication", "1", "--", "job.py"], "no blobs given"),
        (["--blob", "a:b:c:d", "--", "job.py"], "bad --blob"),
        (["--blob", "k:../x", "--", "job.py"], "invalid localname"),
        (["--blob", "k"], "nothing to submit"),
        (["--blob", "k", "--", "--conf", "spark.blobha.on.replication.timeout=later", "job.py"],
         "expected 'proceed' or 'fail'"),
        (["--blob", "k", "--max-wait", "-5", "--", "job.py"], "use -1 to wait forever"),
    ],
)
def test_bad_command_lines(
    argv: list[str], message: str, caplog: pytest.LogCaptureFixture, cluster: LocalCluster
) -> None:
    status = blobspark.submit_main(["--cluster", cluster.cluster, *argv])
    assert status == 6  # InvalidArgument, before anything is asked of the cluster
    assert message in caplog.text
