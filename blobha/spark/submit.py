"""The launcher, ``blobha spark-submit``: wait for the job's blobs, then run spark-submit."""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any

from blobha.core import settings as settings_reader
from blobha.core.errors import BlobError, InvalidArgument
from blobha.spark.blobmap import BlobSpec, blob_map_json, parse_blob_arg, parse_blob_map
from blobha.spark.codemap import KIND_ARCHIVE
from blobha.spark.conf import (
    CONF_CACHE_DIR,
    CONF_CLUSTER,
    CONF_MAP,
    CONF_MAX_WAIT,
    CONF_MIN_REPLICATION,
    CONF_ON_TIMEOUT,
    CONF_PREFIX,
    CONF_UPDATE_INTERVAL,
    CONF_USER,
    DEFAULT_MAX_WAIT_SECS,
    DEFAULT_MIN_REPLICATION,
    ENV_CONF,
    POLICIES,
)
from blobha.spark.driver import check_access, job_user, wait_for_replication
from blobha.spark.jobcode import (
    FileDigests,
    TakenCode,
    check_archive,
    code_confs,
    deploy_mode_of,
    driver_pythonpath,
    hash_path,
    hook_path,
    insert_options,
    redacted,
    secret_properties,
    take_code,
    upload_code,
)
from blobha.spark.minimums import merge_min_versions
from blobha.spark.settings import SparkBlobSettings
from blobha.spark.submitconf import (
    effective_conf,
    find_spark_submit,
    interpreter_env,
    properties_layer,
    pyspark_submit_path,
    scan_submit_args,
    with_properties_file,
    write_properties,
)

if TYPE_CHECKING:
    import argparse

__all__ = ["build_submit_command", "pyspark_submit_path", "submit_main"]

log = logging.getLogger("blobha.spark")

_SUBMIT_USAGE = (
    "blobha spark-submit [--blob KEY[:LOCALNAME][:uncompress]]... [--blob-map JSON]"
    " [--min-replication N] [--max-wait SECS] [--on-timeout {proceed,fail}]"
    " [--cluster HOST:PORT[,...]] [--user USER] [--cache-dir DIR] [--update-interval SECS]"
    " [--token-lifetime DURATION] [--spark-submit PATH] [--dry-run] -- SPARK_SUBMIT_ARGS..."
)


def _duration_arg(text: str) -> float:
    import argparse

    try:
        return settings_reader.duration(text)
    except settings_reader.SettingError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None


def _submit_parser() -> argparse.ArgumentParser:
    import argparse  # the launcher's only: not loaded in the workers

    p = argparse.ArgumentParser(
        prog="blobha spark-submit",
        usage=_SUBMIT_USAGE,
        description=(
            "Wait until the job's blobs are readable and replicated, then run spark-submit with"
            " the blob map and cluster in its configuration; the job reads blobs with"
            " blobha.spark.blob_path(LOCALNAME)."
        ),
        epilog=(
            "spark.blobha.* settings are read as spark-submit reads them (--conf in"
            " SPARK_SUBMIT_ARGS over --properties-file over spark-defaults.conf); the options"
            " here win. Exit status: that of spark-submit, or 3 (a blob is"
            " missing), 5 (a blob is not readable), 12 (replication not reached, policy"
            " fail), 6 (an invalid setting), 2 (bad command line)."
        ),
    )
    p.add_argument(
        "--blob", action="append", default=[], metavar="KEY[:LOCALNAME][:uncompress]",
        help="a blob the job needs; repeat for more",
    )
    p.add_argument("--blob-map", metavar="JSON", help=f"a whole blob map, as {CONF_MAP}")
    p.add_argument("--min-replication", type=int, metavar="N",
                   help=f"replicas required before launch (default {DEFAULT_MIN_REPLICATION})")
    p.add_argument("--max-wait", type=_duration_arg, metavar="SECS",
                   help="longest wait: seconds or a Spark time string (5min), -1 = forever"
                   f" (default {DEFAULT_MAX_WAIT_SECS:g})")
    p.add_argument("--on-timeout", choices=POLICIES,
                   help="after the wait: launch anyway (default) or fail")
    p.add_argument("--cluster", metavar="HOST:PORT[,...]",
                   help="masters (default: $BLOBHA_CLUSTER)")
    p.add_argument("--user", help="the job's identity, on the driver and every executor"
                   " (default: $BLOBHA_USER, $SPARK_USER, then the OS user)")
    p.add_argument("--cache-dir", metavar="DIR",
                   help="node-local cache directory on every node (default: $BLOBHA_CACHE_DIR"
                   " there, else ~/.cache/blobha)")
    p.add_argument("--update-interval", type=_duration_arg, metavar="SECS",
                   help="how soon running jobs see new versions (seconds, or 30s, 2min)")
    p.add_argument("--token-lifetime", type=_duration_arg, default=86400.0, metavar="DURATION",
                   help="lifetime of the job token the executors get when this launcher holds"
                   " a user token (seconds, or 12h, 2d; default 24h)")
    p.add_argument("--spark-submit", dest="spark_submit", metavar="PATH",
                   help="spark-submit to run (default: $SPARK_HOME/bin/spark-submit, else"
                   " spark-submit on PATH, else the pyspark package's)")
    p.add_argument("--dry-run", action="store_true",
                   help="check the blobs and print the command, without waiting or running it")
    return p


def build_submit_command(
    settings: SparkBlobSettings, spark_submit: str, spark_args: Sequence[str]
) -> list[str]:
    """``spark-submit`` with the blob configuration in front of the user's arguments: every
    ``spark.blobha.*`` key for the driver, and the same as one JSON environment variable for
    every executor (``spark.executorEnv.BLOBHA_SPARK_CONF``)."""
    confs: list[str] = []
    for key, value in settings.to_conf().items():
        confs += ["--conf", f"{key}={value}"]
    confs += ["--conf", f"spark.executorEnv.{ENV_CONF}={settings.to_json()}"]
    return [spark_submit, *confs, *spark_args]


def _settings_from_args(
    args: argparse.Namespace, conf: Mapping[str, str], has_code: bool = False
) -> SparkBlobSettings:
    # Only our keys: the rest of the conf is spark-submit's business.
    merged = {k: v for k, v in conf.items() if k.startswith(CONF_PREFIX)}
    blobs = list(parse_blob_map(merged.get(CONF_MAP)))
    if args.blob_map:
        blobs += parse_blob_map(args.blob_map)
    blobs += [parse_blob_arg(b) for b in args.blob]
    by_key: dict[str, BlobSpec] = {}
    for spec in blobs:
        by_key[spec.key] = spec  # later mentions of a key win: the command line over --conf
    merged[CONF_MAP] = blob_map_json(by_key.values())
    for key, value in (
        (CONF_MIN_REPLICATION, args.min_replication),
        (CONF_MAX_WAIT, args.max_wait),
        (CONF_ON_TIMEOUT, args.on_timeout),
        (CONF_CLUSTER, args.cluster),
        (CONF_USER, args.user),
        (CONF_CACHE_DIR, args.cache_dir),
        (CONF_UPDATE_INTERVAL, args.update_interval),
    ):
        if value is not None:
            merged[key] = str(value)
    settings = SparkBlobSettings.from_conf(merged)  # re-validates localname clashes too
    if not settings.blobs and not has_code:
        raise InvalidArgument(
            "no blobs given: use --blob KEY[:LOCALNAME][:uncompress], or --py-files, --files"
            " or --archives among the spark-submit arguments"
        )
    from blobha.client import default_user

    # The job runs as spark-submit's user (or its --proxy-user, which Spark checks); the blob
    # store must see the same identity on the driver and on every executor, whatever OS user
    # the executors run as.
    user = settings.user or job_user(
        lambda: os.environ.get("SPARK_USER", "").strip() or default_user())
    return settings.replace(user=user, cluster=settings.resolved_cluster())



def _configure_logging() -> None:
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("blobha spark-submit: %(levelname)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def _run(command: list[str], env: dict[str, str]) -> int:
    proc = subprocess.Popen(command, env=env)
    previous: Any = None
    forwarding = threading.current_thread() is threading.main_thread()
    if forwarding:
        # A scheduler stopping the launcher (SIGTERM) must stop the Spark application too;
        # Ctrl-C already reaches the child through the terminal's process group.
        def forward(signum: int, frame: FrameType | None) -> None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signum)

        previous = signal.signal(signal.SIGTERM, forward)
    try:
        while True:
            try:
                return proc.wait()
            except KeyboardInterrupt:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                return 130
    finally:
        if forwarding:
            signal.signal(signal.SIGTERM, previous)


def submit_main(argv: list[str]) -> int:
    """``blobha spark-submit``: wait for the blobs, then run spark-submit; returns the exit
    status (spark-submit's own once it ran).

    Usage::

        blobha spark-submit --blob KEY[:LOCALNAME][:uncompress] ... [--blob-map JSON]
            [--min-replication N] [--max-wait SECS] [--on-timeout proceed|fail]
            [--cluster HOST:PORT,...] [--user USER] [--cache-dir DIR]
            [--update-interval SECS] [--token-lifetime DURATION] [--spark-submit PATH]
            [--dry-run]
            -- SPARK_SUBMIT_ARGS...

    Example::

        blobha spark-submit --blob geo-table:geo.bin --blob model.tgz:model:uncompress \\
            --min-replication 2 --max-wait 120 -- --master yarn enrich.py --day 2024-05-01

    ``PYSPARK_PYTHON`` is set to this interpreter (which has blobha installed) only for a
    ``local``/``local-cluster`` master, where the executors run on this machine, and only
    when neither the environment nor ``spark.pyspark.python`` names one (see
    :func:`~blobha.spark.submitconf.interpreter_env`).
    """
    parser = _submit_parser()
    if "--" in argv:
        cut = argv.index("--")
        ours, spark_args = list(argv[:cut]), list(argv[cut + 1 :])
    else:
        ours, spark_args = list(argv), []
    try:
        args = parser.parse_args(ours)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    _configure_logging()
    try:
        submit = scan_submit_args(spark_args)
        rest = list(submit.rest)
        if not rest:
            raise InvalidArgument(
                "nothing to submit: put the spark-submit arguments after '--', e.g."
                " -- --master local[2] job.py"
            )
        spark_submit = find_spark_submit(args.spark_submit, os.environ)
        conf = effective_conf(submit, os.environ, spark_submit)
        taken: TakenCode | None = None
        digests: dict[str, FileDigests] = {}
        if deploy_mode_of(submit, conf, os.environ) == "client":
            taken = take_code(rest, conf)
            if not taken.files:
                taken = None
        else:
            log.info("cluster deploy mode: the job's code travels as spark-submit ships it")
        settings = _settings_from_args(args, conf, has_code=taken is not None)
        if taken is not None:
            # A missing or unreadable file fails here, before anything is uploaded.
            digests = {f.path: hash_path(f.path) for f in taken.files}
        if args.dry_run:
            for f in taken.files if taken is not None else ():
                if f.kind == KIND_ARCHIVE:
                    check_archive(f.path, f.name)
            from blobha.client import Client

            with Client(settings.resolved_cluster(), user=settings.user,
                        timeout=settings.client_timeout_secs) as c:
                check_access(c, settings.keys)
            print(shlex.join(redacted(build_submit_command(settings, spark_submit, rest))))
            return 0
        # Settings have blobs or code (else _settings_from_args refused them): one client
        # stores the code, obtains the job token and waits for replication.
        settings, secrets = _store_code_and_token(settings, taken, digests, args.token_lifetime)
        # Spark reads one properties file: the one it would have read comes along, under ours.
        props = {**properties_layer(submit, os.environ, spark_submit), **secrets} if secrets \
            else None
    except BlobError as exc:
        log.error("%s", " ".join(str(exc).split()))
        return exc.exit_code
    except KeyboardInterrupt:
        log.error("interrupted")
        return 130
    env = dict(os.environ)
    # Our interpreter only where the executors run on this machine (see interpreter_env):
    # PYSPARK_PYTHON travels to every executor, and other nodes lack this path.
    env.update(interpreter_env(submit, conf, env, sys.executable))
    extra: list[str] = []
    if taken is not None:
        rest = list(taken.args)
        extra += code_confs(submit, conf, env, hook_path(submit, conf, env))
        driver_path = driver_pythonpath(taken.files)
        if driver_path:
            # The client-mode driver imports the py-files from where they are, as spark-submit
            # would have let it; they are not served to anyone.
            env["PYTHONPATH"] = os.pathsep.join(
                [driver_path, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    submit_args = insert_options(rest, extra)
    with contextlib.ExitStack() as stack:
        if props is not None:
            path = stack.enter_context(_private_properties(props))
            submit_args = with_properties_file(submit_args, path, secrets)
            rest = with_properties_file(rest, path, secrets)
        command = build_submit_command(settings, spark_submit, submit_args)
        log.info("running %s", shlex.join([*command[:1], "(blobha --conf ...)", *rest]))
        try:
            return _run(command, env)
        except OSError as exc:
            log.error("cannot run %s: %s", spark_submit, exc.strerror or exc)
            return 1


@contextlib.contextmanager
def _private_properties(entries: Mapping[str, str]) -> Iterator[str]:
    """A properties file of ``entries``, mode 600 in a directory of its own (0700), for as
    long as spark-submit runs: removed when it exits, fails or is interrupted. (A launcher
    killed outright leaves it in the temporary directory, readable by this account only.)"""
    import shutil
    import tempfile

    directory = tempfile.mkdtemp(prefix="blobha-submit-")  # mode 0700
    try:
        path = os.path.join(directory, "spark-submit.properties")
        write_properties(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), entries)
        yield path
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _store_code_and_token(
    settings: SparkBlobSettings, taken: TakenCode | None, digests: Mapping[str, FileDigests],
    lifetime: float,
) -> tuple[SparkBlobSettings, dict[str, str]]:
    """Upload the code that is not stored yet; with a user token, obtain the executors' job
    token for exactly the job's keys; wait for their replication. The settings with the code
    map, and the secret conf entries (none without a job token)."""
    from blobha.client import Client
    from blobha.core.auth import is_job_token, job_token_id
    from blobha.wire.credentials import Credentials

    creds = Credentials.from_env().check()
    with Client(settings.resolved_cluster(), user=settings.user,
                timeout=settings.client_timeout_secs, credentials=creds) as c:
        if taken is not None:
            specs = upload_code(c, c.user, taken.files, digests)
            settings = settings.replace(code=tuple(specs))
        confs: dict[str, str] = {}
        token = creds.token()
        if token and not is_job_token(token):
            job = c.issue_job_token(settings.all_keys, max(1, int(lifetime)))
            log.info("job token %s for %d key(s)", job_token_id(job.token), len(settings.all_keys))
            confs = secret_properties(job.token, creds.ca, creds.require_tls)
        report = wait_for_replication(settings.all_keys, settings.min_replication,
                                      settings.max_wait_secs, on_timeout=settings.on_timeout,
                                      client=c)
    # What the wait saw goes to the executors, which read at least that (an update just
    # before the launch included, from a master still behind it).
    seen = merge_min_versions(settings.min_versions, report.seen)
    return settings.replace(min_versions=seen), confs
