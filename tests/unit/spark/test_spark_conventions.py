"""The launcher's real-cluster conventions, without a cluster or a JVM: which spark-submit runs,
where ``spark.blobha.*`` comes from (spark-defaults.conf, --properties-file, --conf, with
Spark's precedence), which interpreter it may name, and Spark's time and size strings in the
Spark conf. The wait is replaced by a recorder and spark-submit by a script that records what
it was given."""

from __future__ import annotations

import itertools
import json
import os
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from blobha.spark import submit as spark_submit
from blobha.spark import submitconf
from blobha.spark.conf import (
    CONF_CACHE_DIR,
    CONF_CACHE_RETENTION,
    CONF_CACHE_SOFT_LIMIT,
    CONF_CLIENT_TIMEOUT,
    CONF_MAP,
    CONF_MAX_WAIT,
    CONF_UPDATE_INTERVAL,
    ENV_CONF,
)
from blobha.spark.settings import NotConfigured, SparkBlobSettings
from blobha.spark.submitconf import (
    effective_conf,
    find_spark_submit,
    interpreter_env,
    is_local_master,
    read_properties,
    scan_submit_args,
)

MAP = '{"geo": {"localname": "geo.bin"}}'


def _script(path: Path, body: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


# --------------------------------------------------------------------------------------------
# Which spark-submit
# --------------------------------------------------------------------------------------------


def test_spark_submit_is_found_in_spark_home_then_path_then_pyspark(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "spark"
    in_home = _script(home / "bin" / "spark-submit")
    on_path = _script(tmp_path / "path" / "spark-submit")
    path = str(on_path.parent)
    assert find_spark_submit("/x/spark-submit", {"SPARK_HOME": str(home)}) == "/x/spark-submit"
    assert find_spark_submit(None, {"SPARK_HOME": str(home), "PATH": path}) == str(in_home)
    assert find_spark_submit(None, {"PATH": path}) == str(on_path)
    monkeypatch.setattr(submitconf, "pyspark_submit_path", lambda: "/pyspark/bin/spark-submit")
    assert find_spark_submit(None, {"PATH": str(tmp_path)}) == "/pyspark/bin/spark-submit"


def test_a_spark_home_without_spark_submit_is_refused(tmp_path: Path) -> None:
    with pytest.raises(NotConfigured, match=r"has no bin/spark-submit: fix SPARK_HOME"):
        find_spark_submit(None, {"SPARK_HOME": str(tmp_path)})


# --------------------------------------------------------------------------------------------
# Reading spark-submit's arguments and properties files
# --------------------------------------------------------------------------------------------


def test_submit_arguments_are_read_as_spark_submit_reads_them() -> None:
    s = scan_submit_args([
        "--master=yarn", "--deploy-mode", "cluster", "--conf", "spark.blobha.user=carol",
        "-c", "spark.executor.cores=2", "--conf=spark.blobha.min.replication=2",
        "--properties-file", "p.conf", "--extra-properties-file", "e1.conf",
        "--extra-properties-file=e2.conf", "--load-spark-defaults", "--verbose",
        "job.py", "--master", "app-arg", "--conf", "spark.blobha.user=app-arg",
    ])
    assert (s.master, s.deploy_mode, s.properties_file) == ("yarn", "cluster", "p.conf")
    assert s.extra_properties_files == ("e1.conf", "e2.conf") and s.load_spark_defaults
    assert s.blobha_confs == {"spark.blobha.user": "carol", "spark.blobha.min.replication": "2"}
    # The spark.blobha.* settings are taken out (the launcher passes the merged ones); the
    # rest, and everything from the application file on, is passed on as given.
    assert s.rest == (
        "--master=yarn", "--deploy-mode", "cluster", "-c", "spark.executor.cores=2",
        "--properties-file", "p.conf", "--extra-properties-file", "e1.conf",
        "--extra-properties-file=e2.conf", "--load-spark-defaults", "--verbose",
        "job.py", "--master", "app-arg", "--conf", "spark.blobha.user=app-arg",
    )


def test_properties_files_are_read_as_java_reads_them(tmp_path: Path) -> None:
    f = tmp_path / "spark-defaults.conf"
    f.write_text(
        "# a comment\n"
        "! another comment\n"
        "\n"
        "spark.blobha.cluster      m1:6627,m2:6627\n"
        "spark.blobha.user=alice\n"
        "spark.blobha.min.replication : 2   \n"
        "   spark.blobha.cache.dir\t/data/blobha-cache\n"
        "spark.blobha.blobstore.map {\"geo\": \\\n"
        "    {\"localname\": \"geo.bin\"}}\n"
        "spark.key\\ with\\ spaces x\\ty\n"
        "spark.unicode \\u00e9t\\u00e9\n"
        "spark.empty\n",
        encoding="utf-8",
    )
    assert read_properties(f) == {
        "spark.blobha.cluster": "m1:6627,m2:6627",
        "spark.blobha.user": "alice",
        "spark.blobha.min.replication": "2",
        "spark.blobha.cache.dir": "/data/blobha-cache",
        CONF_MAP: MAP,
        "spark.key with spaces": "x\ty",
        "spark.unicode": "été",
        "spark.empty": "",
    }
    with pytest.raises(Exception, match=r"cannot read the properties file .*missing\.conf"):
        read_properties(tmp_path / "missing.conf")


@pytest.fixture
def conf_files(tmp_path: Path) -> dict[str, Path]:
    def write(name: str, **conf: str) -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(f"{k.replace('_', '.')} {v}\n" for k, v in conf.items()))
        return path

    return {
        "defaults": write("conf-dir/spark-defaults.conf", a="defaults", b="defaults",
                          c="defaults", d="defaults"),
        "home-defaults": write("home/conf/spark-defaults.conf", a="home"),
        "props": write("props.conf", b="props", c="props", e="props"),
        "extra1": write("extra1.conf", c="extra1", f="extra1"),
        "extra2": write("extra2.conf", f="extra2"),
    }


def test_spark_conf_precedence(conf_files: dict[str, Path]) -> None:
    env = {"SPARK_CONF_DIR": str(conf_files["defaults"].parent),
           "SPARK_HOME": str(conf_files["home-defaults"].parents[1])}

    def conf(*args: str) -> dict[str, str]:
        return effective_conf(scan_submit_args([*args, "job.py"]), env, "/no/spark-submit")

    # spark-defaults.conf from $SPARK_CONF_DIR (over $SPARK_HOME/conf); --conf over it.
    assert conf("--conf", "a=cli") == {"a": "cli", "b": "defaults", "c": "defaults",
                                       "d": "defaults"}
    # --properties-file replaces spark-defaults.conf entirely, as in Spark.
    props = str(conf_files["props"])
    assert conf("--properties-file", props, "--conf", "c=cli") == {
        "b": "props", "c": "cli", "e": "props"}
    # Spark 4's --load-spark-defaults keeps it, under the properties file.
    assert conf("--properties-file", props, "--load-spark-defaults") == {
        "a": "defaults", "b": "props", "c": "props", "d": "defaults", "e": "props"}
    # --extra-properties-file (Spark 4.1) overrides --properties-file; a later one wins;
    # --conf still wins over all.
    assert conf("--properties-file", props, "--extra-properties-file", str(conf_files["extra1"]),
                "--extra-properties-file", str(conf_files["extra2"]), "--conf", "b=cli") == {
        "b": "cli", "c": "extra1", "e": "props", "f": "extra2"}
    # A later --conf of the same key wins.
    assert conf("--conf", "a=1", "--conf", "a=2")["a"] == "2"
    # Without $SPARK_CONF_DIR, $SPARK_HOME/conf.
    del env["SPARK_CONF_DIR"]
    assert conf() == {"a": "home"}


def test_spark_defaults_of_the_spark_submit_run(tmp_path: Path) -> None:
    # Without SPARK_HOME, spark-submit takes the directory above its bin/ for it.
    script = _script(tmp_path / "dist" / "bin" / "spark-submit")
    (tmp_path / "dist" / "conf").mkdir()
    (tmp_path / "dist" / "conf" / "spark-defaults.conf").write_text("spark.blobha.user dist\n")
    got = effective_conf(scan_submit_args(["job.py"]), {}, str(script))
    assert got == {"spark.blobha.user": "dist"}
    assert effective_conf(scan_submit_args(["job.py"]), {}, "/nowhere/spark-submit") == {}


# --------------------------------------------------------------------------------------------
# The interpreter
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "master, local",
    [("local", True), ("local[2]", True), ("local[*]", True), ("local[4,2]", True),
     ("local-cluster[2,1,1024]", True), ("yarn", False), ("spark://m:7077", False),
     ("k8s://https://api:6443", False), ("localhost", False)],
)
def test_local_masters(master: str, local: bool) -> None:
    assert is_local_master(master) is local


LAUNCHER = "/home/me/venv/bin/python"


@pytest.mark.parametrize(
    "args, conf, env, added",
    [
        # Executors on this machine: the launcher's interpreter (it has blobha).
        (["--master", "local[2]"], {}, {}, {"PYSPARK_PYTHON": LAUNCHER}),
        (["--master", "local-cluster[2,1,1024]"], {}, {},
         {"PYSPARK_PYTHON": LAUNCHER}),
        ([], {}, {}, {"PYSPARK_PYTHON": LAUNCHER}),  # spark-submit's default: local[*]
        ([], {"spark.master": "local[1]"}, {}, {"PYSPARK_PYTHON": LAUNCHER}),
        # Other nodes: never the launcher's path for executors; the client-mode driver (here)
        # gets it.
        (["--master", "yarn"], {}, {}, {"PYSPARK_DRIVER_PYTHON": LAUNCHER}),
        ([], {"spark.master": "spark://m:7077"}, {}, {"PYSPARK_DRIVER_PYTHON": LAUNCHER}),
        ([], {}, {"MASTER": "yarn"}, {"PYSPARK_DRIVER_PYTHON": LAUNCHER}),
        (["--master", "k8s://https://api:6443", "--deploy-mode", "cluster"], {}, {}, {}),
        (["--master", "yarn"], {"spark.submit.deployMode": "cluster"}, {}, {}),
        # The user's choice stands.
        (["--master", "local[2]"], {"spark.pyspark.python": "/opt/py"}, {}, {}),
        (["--master", "local[2]"], {}, {"PYSPARK_PYTHON": "/opt/py"}, {}),
        (["--master", "yarn"], {"spark.pyspark.driver.python": "/opt/py"}, {}, {}),
        (["--master", "yarn"], {}, {"PYSPARK_DRIVER_PYTHON": "/opt/py"}, {}),
        (["--master", "yarn"], {}, {"PYSPARK_PYTHON": "/opt/py"}, {}),
    ],
)
def test_the_launcher_names_its_interpreter_only_where_it_exists(
    args: list[str], conf: dict[str, str], env: dict[str, str], added: dict[str, str]
) -> None:
    submit = scan_submit_args([*args, "job.py"])
    assert interpreter_env(submit, conf, env, LAUNCHER) == added


# --------------------------------------------------------------------------------------------
# Time and size strings in the Spark conf
# --------------------------------------------------------------------------------------------


def test_durations_and_sizes_in_the_spark_conf() -> None:
    s = SparkBlobSettings.from_conf({
        CONF_MAP: MAP, CONF_MAX_WAIT: "5min", CONF_CACHE_RETENTION: "2h",
        CONF_UPDATE_INTERVAL: "500ms", CONF_CLIENT_TIMEOUT: "1d", CONF_CACHE_SOFT_LIMIT: "10g",
    })
    assert (s.max_wait_secs, s.cache_retention_secs, s.update_interval_secs,
            s.client_timeout_secs) == (300.0, 7200.0, 0.5, 86400.0)
    assert s.cache_soft_limit_bytes == 10 * 1024**3
    # Executors get plain seconds and bytes, which any version reads.
    carried = json.loads(s.to_json())
    assert (carried[CONF_MAX_WAIT], carried[CONF_CACHE_SOFT_LIMIT]) == ("300", str(10 << 30))
    assert SparkBlobSettings.from_json(s.to_json()) == s
    # Plain numbers keep their meaning, -1 still waits forever.
    plain = SparkBlobSettings.from_conf({CONF_MAX_WAIT: "-1", CONF_CACHE_SOFT_LIMIT: "4096",
                                         CONF_UPDATE_INTERVAL: "2.5"})
    assert (plain.max_wait_secs, plain.cache_soft_limit_bytes,
            plain.update_interval_secs) == (-1.0, 4096, 2.5)


@pytest.mark.parametrize(
    "key, value, message",
    [(CONF_CACHE_SOFT_LIMIT, "10 apples", "expected a size in bytes such as"),
     (CONF_CACHE_SOFT_LIMIT, "1.5g", "whole number"),
     (CONF_UPDATE_INTERVAL, "soon", "expected a duration such as"),
     (CONF_MAX_WAIT, "-2min", "use -1 to wait forever")],
)
def test_bad_durations_and_sizes_name_the_key(key: str, value: str, message: str) -> None:
    with pytest.raises(Exception, match=rf"{key}='{value}': .*{message}"):
        SparkBlobSettings.from_conf({key: value})


# --------------------------------------------------------------------------------------------
# The launcher, end to end (the wait recorded, spark-submit a stand-in)
# --------------------------------------------------------------------------------------------


class Launch:
    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.record = tmp_path / "submitted.json"
        self.script = tmp_path / "spark-submit"
        self.script.write_text(
            f"#!{sys.executable}\n"
            "import json, os, sys\n"
            f"out = open({str(self.record)!r}, 'w')\n"
            "json.dump({'argv': sys.argv[1:], 'env': dict(os.environ)}, out)\n"
        )
        self.script.chmod(self.script.stat().st_mode | stat.S_IXUSR)
        self.waits: list[dict[str, Any]] = []
        self.monkeypatch = monkeypatch

        def wait(keys: Any, minimum: int, max_wait: float, **kw: Any) -> Any:
            self.waits.append({"keys": tuple(keys), "min": minimum, "max_wait": max_wait, **kw})
            return SimpleNamespace(seen=())  # what the report says the launcher uses

        monkeypatch.setattr(spark_submit, "wait_for_replication", wait)
        for var in ("SPARK_HOME", "SPARK_CONF_DIR", "PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON",
                    "MASTER", "DEPLOY_MODE", ENV_CONF, "BLOBHA_CLUSTER"):
            monkeypatch.delenv(var, raising=False)

    def __call__(self, *argv: str) -> dict[str, Any]:
        status = spark_submit.submit_main([
            "--cluster", "127.0.0.1:1", "--user", "bob", "--spark-submit", str(self.script),
            *argv,
        ])
        assert status == 0
        submitted: dict[str, Any] = json.loads(self.record.read_text())
        confs = {}
        args = submitted["argv"]
        for flag, value in itertools.pairwise(args):
            if flag == "--conf":
                key, _, v = value.partition("=")
                confs[key] = v
        submitted["confs"] = confs
        submitted["carried"] = SparkBlobSettings.from_json(confs[f"spark.executorEnv.{ENV_CONF}"])
        return submitted


@pytest.fixture
def launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Launch]:
    yield Launch(tmp_path, monkeypatch)


def test_the_launcher_reads_spark_defaults_and_properties_files(
    launch: Launch, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf_dir = tmp_path / "conf"
    conf_dir.mkdir()
    (conf_dir / "spark-defaults.conf").write_text(
        f"spark.blobha.blobstore.map {MAP}\n"
        "spark.blobha.min.replication 2\n"
        "spark.blobha.max.replication.wait.secs 5min\n"
        "spark.blobha.cache.dir /data/blobha-cache\n"
        "spark.blobha.cache.soft.limit.bytes 20g\n"
    )
    monkeypatch.setenv("SPARK_CONF_DIR", str(conf_dir))
    got = launch("--", "--master", "yarn", "job.py")
    assert launch.waits[-1]["keys"] == ("geo",)
    assert (launch.waits[-1]["min"], launch.waits[-1]["max_wait"]) == (2, 300.0)
    # On every node: the executors' carrier holds the node-wide cache directory.
    carried = got["carried"]
    assert carried.cache_dir == "/data/blobha-cache"
    assert carried.cache_soft_limit_bytes == 20 << 30
    assert got["confs"][CONF_CACHE_DIR] == "/data/blobha-cache"  # and the driver's conf
    # Executors on other nodes: no launcher path imposed on them.
    assert "PYSPARK_PYTHON" not in got["env"]
    assert got["env"]["PYSPARK_DRIVER_PYTHON"] == sys.executable

    # --conf over spark-defaults.conf; the launcher's own options over both.
    got = launch("--min-replication", "3", "--", "--master", "yarn",
                 "--conf", "spark.blobha.cache.dir=/ssd/cache",
                 "--conf", "spark.blobha.min.replication=1", "job.py")
    assert got["carried"].cache_dir == "/ssd/cache" and launch.waits[-1]["min"] == 3

    # --properties-file replaces spark-defaults.conf entirely.
    props = tmp_path / "job.conf"
    props.write_text(f"spark.blobha.blobstore.map {MAP}\nspark.blobha.update.interval.secs 2min\n")
    got = launch("--", "--properties-file", str(props), "--master", "local[2]", "job.py")
    assert got["carried"].cache_dir is None
    assert got["carried"].update_interval_secs == 120.0
    assert (launch.waits[-1]["min"], launch.waits[-1]["max_wait"]) == (1, 60.0)
    # A local master runs the executors here: the launcher's interpreter serves them.
    assert got["env"]["PYSPARK_PYTHON"] == sys.executable


def test_the_cache_directory_reaches_blob_path_on_executors(
    launch: Launch, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An executor reads the carrier the launcher set (spark.executorEnv.BLOBHA_SPARK_CONF);
    # blob_path's cache is the configured directory, not the node's default.
    from blobha.spark import executor

    monkeypatch.setenv("BLOBHA_CACHE_DIR", str(tmp_path / "node-default"))
    got = launch("--blob", "geo:geo.bin", "--", "--master", "yarn",
                 "--conf", f"spark.blobha.cache.dir={tmp_path / 'shared'}", "job.py")
    monkeypatch.setenv(ENV_CONF, got["confs"][f"spark.executorEnv.{ENV_CONF}"])
    settings = executor.current_settings()
    assert settings.resolved_cache_dir() == str(tmp_path / "shared")
    cache = executor._Localizer()._cache(settings)
    assert cache.directory == tmp_path / "shared"


def test_the_launcher_option_names_a_missing_properties_file(
    launch: Launch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    status = spark_submit.submit_main([
        "--blob", "geo", "--cluster", "127.0.0.1:1", "--spark-submit", str(launch.script),
        "--", "--properties-file", str(tmp_path / "nope.conf"), "job.py",
    ])
    assert status == 6
    assert "cannot read the properties file" in caplog.text and "nope.conf" in caplog.text


def test_the_launcher_takes_time_strings(launch: Launch) -> None:
    launch("--blob", "geo", "--max-wait", "2min", "--update-interval", "500ms", "--",
           "job.py")
    assert launch.waits[-1]["max_wait"] == 120.0


def test_a_bad_time_string_is_a_usage_error(
    launch: Launch, capsys: pytest.CaptureFixture[str]
) -> None:
    status = spark_submit.submit_main(["--blob", "geo", "--max-wait", "soon", "--", "job.py"])
    assert status == 2
    assert "argument --max-wait: 'soon': expected a duration such as" in capsys.readouterr().err



# --------------------------------------------------------------------------------------------
# Secrets in a private properties file, never on spark-submit's command line
# --------------------------------------------------------------------------------------------

PEM = "-----BEGIN CERTIFICATE-----\nMIIB+zCCAaGg\nAwIBAgIU==\n-----END CERTIFICATE-----\n"


def test_properties_are_written_as_java_and_spark_read_them(tmp_path: Path) -> None:
    entries = {
        "spark.executorEnv.BLOBHA_CA_PEM": PEM.strip(),  # Spark trims values: so do we
        "key = with: all#the!specials": " leading space, = : # ! \\ back\\slash",
        "spark.unicode": "été ✓",
        "spark.controls": "a\tb\rc\fd\x01e",
        "spark.empty": "",
        "#not a comment": "!nor this",
    }
    path = tmp_path / "out.properties"
    submitconf.write_properties(
        os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), entries)
    assert submitconf.read_properties(path) == {
        **entries, "key = with: all#the!specials": entries["key = with: all#the!specials"].strip()}
    assert path.read_text(encoding="utf-8").count("\n") == len(entries)  # one line each


def test_the_properties_file_replaces_the_users_and_takes_the_secret_confs_out() -> None:
    secret = ["spark.executorEnv.BLOBHA_JOB_TOKEN"]
    args = ["--master", "yarn", "--properties-file", "theirs.conf", "-c", "a=1",
            "--conf", "spark.executorEnv.BLOBHA_JOB_TOKEN=bjt1.theirs", "--verbose",
            "--properties-file=also.conf", "--conf=spark.executorEnv.BLOBHA_JOB_TOKEN=x",
            "job.py", "--properties-file", "the job's own argument"]
    assert submitconf.with_properties_file(args, "/p/ours", secret) == [
        "--master", "yarn", "-c", "a=1", "--verbose", "--properties-file", "/p/ours",
        "job.py", "--properties-file", "the job's own argument"]
    assert submitconf.with_properties_file(["--class", "Main"], "/p", secret) == [
        "--class", "Main", "--properties-file", "/p"]


@pytest.fixture
def token_launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Launch:
    """A launch whose launcher obtained a job token (and the cluster uses TLS); its fake
    spark-submit records, while it runs, the properties file it was given and its modes."""
    launch = Launch(tmp_path, monkeypatch)
    launch.script.write_text(
        f"#!{sys.executable}\n"
        "import json, os, stat, sys\n"
        "argv = sys.argv[1:]\n"
        "path = argv[argv.index('--properties-file') + 1]\n"
        "mode = lambda p: stat.S_IMODE(os.stat(p).st_mode)\n"
        f"json.dump({{'argv': argv, 'env': dict(os.environ), 'path': path,\n"
        "           'text': open(path, encoding='utf-8').read(), 'mode': mode(path),\n"
        "           'dir_mode': mode(os.path.dirname(path))},\n"
        f"          open({str(launch.record)!r}, 'w'))\n"
        "sys.exit(int(os.environ.get('FAKE_SUBMIT_STATUS', '0')))\n")

    def store(settings: SparkBlobSettings, *args: Any) -> Any:
        return settings, {"spark.blobha.job.token": "bjt1.0123456789abcdef.s3cr3t",
                          "spark.executorEnv.BLOBHA_JOB_TOKEN": "bjt1.0123456789abcdef.s3cr3t",
                          "spark.executorEnv.BLOBHA_CA_PEM": PEM.strip()}

    monkeypatch.setattr(spark_submit, "_store_code_and_token", store)
    return launch


def test_the_job_token_and_ca_go_in_a_private_properties_file_removed_after(
    token_launch: Launch, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf_dir = tmp_path / "conf"
    conf_dir.mkdir()
    (conf_dir / "spark-defaults.conf").write_text(
        "spark.eventLog.enabled true\nspark.executorEnv.BLOBHA_JOB_TOKEN old\n")
    monkeypatch.setenv("SPARK_CONF_DIR", str(conf_dir))
    got = token_launch("--blob", "geo", "--", "--master", "yarn", "job.py")
    assert not any("bjt1." in a or "BEGIN CERTIFICATE" in a for a in got["argv"]), got["argv"]
    assert "bjt1." not in json.dumps(got["env"])
    # The file spark-submit reads instead of spark-defaults.conf carries it: theirs, then ours.
    props = got["text"]
    assert props.index("spark.eventLog.enabled") < props.index("BLOBHA_JOB_TOKEN")
    written = tmp_path / "seen.properties"
    written.write_text(props, encoding="utf-8")
    assert submitconf.read_properties(written) == {
        "spark.eventLog.enabled": "true",
        "spark.blobha.job.token": "bjt1.0123456789abcdef.s3cr3t",
        "spark.executorEnv.BLOBHA_JOB_TOKEN": "bjt1.0123456789abcdef.s3cr3t",
        "spark.executorEnv.BLOBHA_CA_PEM": PEM.strip()}
    assert (got["mode"], got["dir_mode"]) == (0o600, 0o700)
    assert not Path(got["path"]).parent.exists()  # gone with spark-submit

    # A --properties-file of the user's replaces spark-defaults.conf: its entries come along.
    theirs = tmp_path / "theirs.conf"
    theirs.write_text("spark.theirs x\n")
    got = token_launch("--blob", "geo", "--", "--properties-file", str(theirs), "job.py")
    assert str(theirs) not in got["argv"] and got["argv"].count("--properties-file") == 1
    assert got["text"].startswith("spark.theirs=x\n") and "eventLog" not in got["text"]

    # Removed when spark-submit fails, and when it cannot even start.
    monkeypatch.setenv("FAKE_SUBMIT_STATUS", "3")
    status = spark_submit.submit_main([
        "--cluster", "127.0.0.1:1", "--user", "bob", "--spark-submit",
        str(token_launch.script), "--blob", "geo", "--", "job.py"])
    assert status == 3
    assert not Path(json.loads(token_launch.record.read_text())["path"]).parent.exists()
    made: list[str] = []
    real = spark_submit._private_properties

    def spy(entries: Any) -> Any:
        made.append("called")
        return real(entries)

    monkeypatch.setattr(spark_submit, "_private_properties", spy)
    before = set(Path(tempfile.gettempdir()).glob("blobha-submit-*"))
    status = spark_submit.submit_main([
        "--cluster", "127.0.0.1:1", "--user", "bob", "--spark-submit",
        str(tmp_path / "no-such-spark-submit"), "--blob", "geo", "--", "job.py"])
    assert status == 1 and made
    assert set(Path(tempfile.gettempdir()).glob("blobha-submit-*")) == before
