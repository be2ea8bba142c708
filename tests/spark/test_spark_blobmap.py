"""The blob map, the settings and their carriers, without Spark or a cluster (fast)."""

from __future__ import annotations

import json

import pytest

from blobha import spark as blobspark
from blobha.core.errors import InvalidArgument
from blobha.spark import BlobSpec, SparkBlobSettings, parse_blob_arg, parse_blob_map
from blobha.spark import driver as spark_driver
from blobha.spark.submitconf import scan_submit_args

pytestmark = pytest.mark.spark  # no Spark needed: runs wherever blobha is installed


def test_storm_shaped_map_with_defaults() -> None:
    specs = parse_blob_map(
        '{"key1": {"localname": "blob_file", "uncompress": false}, "key2": {},'
        ' "libs.tgz": {"uncompress": true}, "key3": null}'
    )
    assert specs == (
        BlobSpec("key1", "blob_file", False),
        BlobSpec("key2", "key2", False),
        BlobSpec("libs.tgz", "libs.tgz", True),
        BlobSpec("key3", "key3", False),
    )
    assert parse_blob_map(json.loads(blobspark.blob_map_json(specs))) == specs
    assert parse_blob_map(None) == () == parse_blob_map("")


@pytest.mark.parametrize(
    "value, message",
    [
        ("[1]", "must be a JSON object"),
        ("{not json", "not valid JSON"),
        ('{"a/b": {}}', "invalid key"),
        ('{"a": {"localname": "../x"}}', "invalid localname"),
        ('{"a": {"localname": ""}}', "invalid localname"),
        ('{"a": {"uncompres": true}}', "unknown field(s) uncompres"),
        ('{"a": {"uncompress": "yes"}}', "must be true or false"),
        ('{"a": {"localname": "x"}, "b": {"localname": "x"}}', "both map to localname 'x'"),
        ('{"a": 3}', "must be an object"),
    ],
)
def test_bad_maps_are_refused_with_the_reason(value: str, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_blob_map(value)


@pytest.mark.parametrize(
    "text, spec",
    [
        ("geo", BlobSpec("geo", "geo", False)),
        ("geo:geo.bin", BlobSpec("geo", "geo.bin", False)),
        ("m.tgz:uncompress", BlobSpec("m.tgz", "m.tgz", True)),
        ("m.tgz:model:uncompress", BlobSpec("m.tgz", "model", True)),
        ("m.tgz::uncompress", BlobSpec("m.tgz", "m.tgz", True)),
        ("k:uncompress:uncompress", BlobSpec("k", "uncompress", True)),
    ],
)
def test_blob_arguments(text: str, spec: BlobSpec) -> None:
    assert parse_blob_arg(text) == spec


def test_settings_round_trip_through_the_executor_carrier() -> None:
    s = SparkBlobSettings.from_conf(
        {
            blobspark.CONF_MAP: '{"geo": {"localname": "geo.bin"}}',
            blobspark.CONF_CLUSTER: "m1:6627,m2:6627",
            blobspark.CONF_USER: "alice",
            blobspark.CONF_MIN_REPLICATION: "2",
            blobspark.CONF_MAX_WAIT: "-1",
            blobspark.CONF_ON_TIMEOUT: "fail",
            blobspark.CONF_UPDATE_INTERVAL: "2.5",
            "spark.app.id": "app-1",
            "spark.master": "yarn",  # not ours: ignored
        }
    )
    assert (s.min_replication, s.max_wait_secs, s.on_timeout) == (2, -1.0, "fail")
    assert s.update_interval_secs == 2.5 and s.cache_dir is None and s.app_id == "app-1"
    assert SparkBlobSettings.from_json(s.to_json()) == s
    assert s.spec("geo.bin").key == "geo"
    with pytest.raises(blobspark.BlobNotMapped, match=r"mapped: geo\.bin"):
        s.spec("nope")


@pytest.mark.parametrize(
    "key, value",
    [
        (blobspark.CONF_MIN_REPLICATION, "two"),
        (blobspark.CONF_MIN_REPLICATION, "-1"),
        (blobspark.CONF_MAX_WAIT, "-2"),
        (blobspark.CONF_MAX_WAIT, "nan"),
        (blobspark.CONF_ON_TIMEOUT, "later"),
        (blobspark.CONF_CLUSTER, "host:99999"),
        (blobspark.CONF_CLIENT_TIMEOUT, "0"),
    ],
)
def test_bad_settings_name_the_key(key: str, value: str) -> None:
    with pytest.raises(InvalidArgument, match="port|" + key.replace(".", r"\.")):
        SparkBlobSettings.from_conf({key: value})


def test_executor_reads_the_environment_carrier(monkeypatch: pytest.MonkeyPatch) -> None:
    carried = SparkBlobSettings(
        blobs=(BlobSpec("geo", "geo.bin"),), cluster="m1:6627", user="bob", app_id="app-9"
    )
    monkeypatch.setenv(blobspark.ENV_CONF, carried.to_json())
    assert blobspark.current_settings() == carried
    assert blobspark.application_id(blobspark.current_settings()) == "app-9"


def test_no_configuration_says_how_to_get_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(blobspark.ENV_CONF, raising=False)
    with pytest.raises(blobspark.NotConfigured, match="blobha spark-submit"):
        blobspark.blob_path("geo.bin")


def test_unmapped_local_name(monkeypatch: pytest.MonkeyPatch) -> None:
    carried = SparkBlobSettings(blobs=(BlobSpec("geo", "geo.bin"),), cluster="m1:6627")
    monkeypatch.setenv(blobspark.ENV_CONF, carried.to_json())
    with pytest.raises(blobspark.BlobNotMapped, match="'other'"):
        blobspark.blob_path("other")


def test_launcher_leaves_application_arguments_alone() -> None:
    submit = scan_submit_args(
        [
            "--master", "yarn", "--conf", "spark.blobha.min.replication=2",
            "--conf=spark.pyspark.python=/opt/py", "-c", "spark.blobha.user=carol",
            "--py-files", "deps.zip", "job.py", "--conf", "spark.blobha.user=not-ours",
        ]
    )
    assert submit.blobha_confs == {
        "spark.blobha.min.replication": "2", "spark.blobha.user": "carol"}
    assert list(submit.rest) == [
        "--master", "yarn", "--conf=spark.pyspark.python=/opt/py", "--py-files", "deps.zip",
        "job.py", "--conf", "spark.blobha.user=not-ours",
    ]
    assert dict(submit.confs)["spark.pyspark.python"] == "/opt/py"


def test_every_option_is_documented() -> None:
    keys = {o.key for o in blobspark.OPTIONS}
    assert {
        blobspark.CONF_MAP, blobspark.CONF_CLUSTER, blobspark.CONF_MIN_REPLICATION,
        blobspark.CONF_MAX_WAIT, blobspark.CONF_ON_TIMEOUT, blobspark.CONF_CACHE_DIR,
        blobspark.CONF_USER, blobspark.CONF_UPDATE_INTERVAL,
    } <= keys
    assert all(o.doc for o in blobspark.OPTIONS)


class _UnreachableDuringTheWait:
    """A client whose access check answers, but whose replication waits find no master."""

    user = "alice"

    def get_meta(self, key: str) -> object:
        from blobha.client import BlobMeta

        return BlobMeta(key, 2, 10, "ab" * 16, (), 3, 1, 1.0, 2.0, "alice", 1)

    def cluster_summary(self) -> object:
        from blobha.core.errors import Unavailable

        raise Unavailable("no leader is elected yet")

    def wait_for_replication(self, keys: list[str], minimum: int, timeout: float) -> object:
        from blobha.core.errors import Unavailable

        raise Unavailable("ZooKeeper is unreachable from every master; retry shortly")


@pytest.mark.parametrize("policy", [blobspark.ON_TIMEOUT_PROCEED, blobspark.ON_TIMEOUT_FAIL])
def test_a_wait_no_master_answers_is_a_timeout_the_policy_decides_on(policy: str) -> None:
    # The launch used to fail with 'unavailable' whatever the policy, once a failover
    # outlasted the wait.
    client: object = _UnreachableDuringTheWait()
    if policy == blobspark.ON_TIMEOUT_FAIL:
        with pytest.raises(blobspark.ReplicationTimeout):
            spark_driver._wait(client, ["a", "b"], 2, 5.0, policy)  # type: ignore[arg-type]
        return
    report = spark_driver._wait(client, ["a", "b"], 2, 5.0, policy)  # type: ignore[arg-type]
    assert not report.reached
    assert [(s.key, s.version, s.replication) for s in report.statuses] == [("a", 2, 1),
                                                                           ("b", 2, 1)]
    assert any("no master answered" in w for w in report.warnings)
