"""Master configuration: a TOML file, then environment overrides, then validation.

Keys are dotted names (Storm's where Storm has the concept). In the file they may be written
flat (``"blobstore.dir" = "/var/lib/blobha"``) or as TOML tables (``[blobstore] dir = ...``).
Every key can be overridden by an environment variable: ``BLOBHA_`` + the key upper-cased with
dots as underscores, e.g. ``BLOBHA_BLOBSTORE_WRITE_QUORUM=2``.

Bad configuration fails at start with :class:`ConfigError` naming the key and what is allowed.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from blobha.core import settings
from blobha.core.auth import MODES, AuthMode


class ConfigError(ValueError):
    """Invalid configuration; the message names the key and the fix."""


@dataclass(frozen=True)
class Option:
    key: str
    default: Any
    doc: str


#: Every configuration key, its default and what it means. docs/configuration.md is made from
#: this (python -m blobha.ops.configdoc).
OPTIONS: tuple[Option, ...] = (
    Option("blobstore.dir", "blobha-data", "Directory where this master keeps blobs."),
    Option(
        "blobstore.replication.factor",
        3,
        "Default replication factor of a new blob (capped at the number of live masters).",
    ),
    Option(
        "blobstore.write.quorum",
        1,
        "Masters that must hold a new version durably before a create or update is acknowledged"
        " (1 = the leader alone, Storm's behaviour). A request may override it.",
    ),
    Option(
        "blobstore.write.forward",
        True,
        "With a write quorum W above 1, the leader sends a write's bytes to W-1 of the other"
        " masters chosen to hold the key while it commits (small writes over a stage link on"
        " their data channel), and each keeps a staged, synced and digest-checked copy: the"
        " commit records the masters that confirmed one and is acknowledged at once when they"
        " make the quorum. Off: the other masters fetch the version after the commit, and the"
        " write waits for their replica nodes.",
    ),
    Option(
        "blobstore.write.timeout.secs",
        30.0,
        "How long a commit waits for the write quorum before failing with DEADLINE_EXCEEDED.",
    ),
    Option(
        "blobstore.upload.expiration.secs",
        600,
        "Idle seconds after which an unfinished upload is aborted and its data deleted.",
    ),
    Option(
        "blobstore.upload.max.per.user",
        64,
        "Unfinished uploads one user may hold open on the leader (each keeps a file open);"
        " more are refused with RESOURCE_EXHAUSTED until some are committed, aborted or"
        " expire. 0 = no limit.",
    ),
    Option(
        "blobstore.keys.max",
        0,
        "The most keys the cluster holds, whoever created them; a create past it is refused"
        " with RESOURCE_EXHAUSTED, before ZooKeeper runs out of heap. Set it from ZooKeeper's"
        " heap: with 3 masters a key takes about 4 KiB of it, beyond 512 MiB for the rest"
        " (docs/operations.md, \"Capacity\"). 0 = no limit.",
    ),
    Option(
        "blobstore.quota.user.keys",
        1_000_000,
        "Keys one user may have created and not deleted (each costs ZooKeeper memory on every"
        " server and an entry on every master); a create past it is refused with"
        " RESOURCE_EXHAUSTED. Admins (auth.admins) are exempt. 0 = no limit.",
    ),
    Option(
        "blobstore.quota.user.bytes",
        0,
        "Bytes the current versions of one user's keys may hold (each copy counted once);"
        " a create or update past it is refused with RESOURCE_EXHAUSTED. Admins are exempt."
        " 0 = no limit (blobstore.disk.reserved.bytes still guards the disk).",
    ),
    Option(
        "blobstore.quota.user.acl.bytes",
        64 * 1024 * 1024,
        "Bytes the ACLs of one user's keys may take in ZooKeeper, together (ACLs are the part"
        " of a key's record its writer sizes: up to 1 MB each); a create or ACL change past"
        " it is refused with RESOURCE_EXHAUSTED. Admins are exempt. 0 = no limit.",
    ),
    Option(
        "blobstore.quota.user.upload.bytes",
        0,
        "Bytes one user's unfinished uploads may hold on the leader's disk together; an"
        " upload that would pass it is refused with RESOURCE_EXHAUSTED (blobha's clients then"
        " abort it, which frees its bytes). Admins are exempt. 0 = no limit.",
    ),
    Option(
        "blobstore.disk.reserved.bytes",
        256 * 1024 * 1024,
        "Free space an upload or a sync may never eat into; refused with RESOURCE_EXHAUSTED.",
    ),
    Option(
        "blobstore.sync.period.secs",
        30.0,
        "Period of the full reconcile that backs up the watch-driven sync (Storm's"
        " nimbus.code.sync.freq.secs; here only a safety net).",
    ),
    Option(
        "blobstore.sync.periodic.keys.per.sec",
        200,
        "Keys a second each master re-reads in that safety-net pass (two ZooKeeper reads"
        " each; 100,000 keys take about 8 minutes). Watches bring changes within"
        " milliseconds; the pass only catches what they cannot, so a faster one mostly adds"
        " load.",
    ),
    Option(
        "blobstore.sync.recursive.watch",
        True,
        "Follow every key's changes through one persistent recursive ZooKeeper watch on"
        " /blobstore (ZooKeeper 3.6 or later). Off: the change journal and a one-shot watch"
        " per key, for older servers (also the fallback when the server refuses it).",
    ),
    Option(
        "blobstore.replica.grace.secs",
        30.0,
        "How long a holder may be gone before another master takes its place.",
    ),
    Option(
        "blobstore.delete.grace.secs",
        5.0,
        "How long a master keeps the local copy of a key deleted in ZooKeeper.",
    ),
    Option(
        "blobstore.versions.retained",
        2,
        "Versions of each key kept on disk (the committed one and older ones for roll-back).",
    ),
    Option(
        "blobstore.sync.threads",
        4,
        "Parallel background downloads on a master.",
    ),
    Option(
        "blobstore.sync.linger.secs",
        0.3,
        "How long a key to replicate may wait for others to join its batch while the master is"
        " already replicating another batch, or while a stream of writes goes on (the last"
        " batch ended less than this long ago and had several keys, or it and the batch before"
        " each had a key that arrived while another batch ran); 0 = never. A stream of small"
        " writes then costs each follower one batch's ZooKeeper reads, fetch call, file-system"
        " syncs and registration for many keys instead of one each. A lone write's key goes at"
        " once, and while writers wait for copies (a write quorum above 1) no key waits longer"
        " than 0.03 s.",
    ),
    Option(
        "blobstore.sync.stall.secs",
        10.0,
        "How long a master's fetch from a peer may receive nothing before that peer counts as"
        " stalled (paused, overloaded or cut off) and the fetch goes on from the next holder;"
        " such a peer is then tried after the others for a minute. Raise it on links where a"
        " healthy peer can fall silent for longer.",
    ),
    Option(
        "blobstore.read.cutoff.secs",
        2.0,
        "How long a master cut off from ZooKeeper keeps answering reads that carry no minimum"
        " version from its last committed view, counted from when its ZooKeeper client notices"
        " (up to two thirds of the session timeout after the last answer). Past it, such reads"
        " are refused as stale and clients ask a master in touch with ZooKeeper, or, when"
        " every master they reach is cut off, ask again for the last known view (a ZooKeeper"
        " outage: nothing newer can commit). Reads with a minimum are served from the last"
        " view whenever it has reached that minimum.",
    ),
    Option(
        "blobstore.scrub.interval.secs",
        86400.0,
        "Seconds between background scrub passes, which re-verify every stored version's"
        " digests so silent corruption is found and repaired from a healthy replica"
        " (0 disables scrubbing).",
    ),
    Option(
        "blobstore.scrub.rate.bytes.per.sec",
        16 * 1024 * 1024,
        "Read rate cap of the scrubber, so it never competes with clients for the disk"
        " (0 = unlimited).",
    ),
    Option("zookeeper.servers", "127.0.0.1:2181", "Comma-separated ZooKeeper host:port list."),
    Option("zookeeper.chroot", "/blobha", "ZooKeeper path under which all blobha state lives."),
    Option(
        "zookeeper.session.timeout.ms",
        20000,
        "ZooKeeper session timeout (the server clamps it to 2x..20x its tickTime).",
    ),
    Option("master.listen", "0.0.0.0:6627", "host:port the gRPC server binds."),
    Option(
        "master.advertise",
        "",
        "host:port other masters and clients use to reach this master; its identity. Defaults"
        " to master.listen with 127.0.0.1 for a wildcard host.",
    ),
    Option(
        "blobstore.data.port",
        "+10",
        "Port of the data channel, which carries downloads and uploads outside gRPC with fewer"
        " copies of each byte (blobha.wire.datachannel), on master.listen's host: a port, '+N'"
        " for the gRPC port plus N (the default, 6637 beside 6627: one fixed port to open in a"
        " firewall), 0 for any free port (clients learn it from each offer), -1 for none. With"
        " TLS it is TLS too, with the master's certificate and client verification. Clients"
        " that cannot reach it, or whose TLS handshake with it fails, use the gRPC stream.",
    ),
    Option("master.principal", "blobha-master", "User name masters use with each other."),
    Option("admins", [], "Users allowed every operation on every blob."),
    Option(
        "auth.mode",
        "simple",
        "Authenticator: 'simple' trusts the user name the client sends; 'token' checks a bearer"
        " token against auth.token.file; 'mtls' takes the user from the client certificate"
        " (needs tls.*).",
    ),
    Option(
        "auth.token.file",
        "",
        "Token mode: file of 'user:scrypt$salt$hash' lines ('blobha token create' makes them);"
        " re-read when it changes. A master refuses one that other accounts can read, or that"
        " its group can change (600, or 640 for a group).",
    ),
    Option(
        "auth.job.token.max.lifetime.secs",
        7 * 24 * 3600,
        "Longest lifetime of a job token ('blobha token job'; docs/security.md, Job tokens): a"
        " longer one asked for is cut to this. Job tokens are not issued in auth.mode 'simple'.",
    ),
    Option(
        "auth.job.token.max.per.user",
        1000,
        "Live (unexpired, unrevoked) job tokens one user may hold; another is refused with"
        " RESOURCE_EXHAUSTED until some expire or are revoked ('blobha token revoke'). Each"
        " is a ZooKeeper record of up to 1 MB. Admins are exempt. 0 = no limit.",
    ),
    Option(
        "blobstore.peer.grant.secs",
        300.0,
        "Lifetime of the grants a master hands node caches in their peer plans"
        " (docs/cache.md, Peer serving): a peer serves a version only against an unexpired one."
        " At most 600 s is used, and peers refuse a grant ending more than 900 s ahead.",
    ),
    Option(
        "blobstore.peer.holder.secs",
        60.0,
        "How long a master remembers a node cache that announced it holds or fetches a version"
        " (caches renew it while they run); in memory only.",
    ),
    Option(
        "auth.mtls.rules",
        ["cn ^(.+)$ \\1"],
        "mtls mode: rules 'cn|san REGEX REPLACEMENT' mapping a client certificate's common name"
        " or subject alternative name to a user; the first match wins.",
    ),
    Option(
        "tls.cert",
        "",
        "PEM certificate of this master; with tls.key, the master serves TLS only. Re-read when"
        " it changes.",
    ),
    Option("tls.key", "", "PEM private key of tls.cert (mode 600: a master refuses one other"
           " accounts can read)."),
    Option(
        "tls.ca",
        "",
        "PEM CA certificate(s) that masters' certificates (and in mtls mode clients') must be"
        " signed by.",
    ),
    Option(
        "zookeeper.auth.scheme",
        "none",
        "'digest' locks blobha's znodes down to the masters' ZooKeeper credentials"
        " (zookeeper.auth.file); 'none' leaves them open to anyone who reaches ZooKeeper.",
    ),
    Option(
        "zookeeper.auth.file",
        "",
        "File holding the masters' ZooKeeper digest credentials as one 'user:password' line"
        " (mode 600: a master refuses one other accounts can read).",
    ),
    Option(
        "zookeeper.ssl.enabled",
        False,
        "Reach ZooKeeper over TLS, at its secureClientPort (zookeeper.servers names those"
        " ports). The digest password, the cluster secret and job-token records cross this"
        " link: without TLS, in clear.",
    ),
    Option(
        "zookeeper.ssl.ca",
        "",
        "PEM CA certificate(s) ZooKeeper's certificate must be signed by; empty: the system's"
        " trusted CAs.",
    ),
    Option(
        "zookeeper.ssl.cert",
        "",
        "PEM client certificate for a ZooKeeper that requires one (its ssl.clientAuth, 'need'"
        " by default); with zookeeper.ssl.key.",
    ),
    Option(
        "zookeeper.ssl.key",
        "",
        "PEM private key of zookeeper.ssl.cert (mode 600: a master refuses one other accounts"
        " can read).",
    ),
    Option(
        "zookeeper.ssl.verify.hostname",
        True,
        "Check that ZooKeeper's certificate names the host zookeeper.servers dials (a DNS"
        " name or IP address in its subject alternative names).",
    ),
    Option(
        "blobstore.list.visibility",
        "readable",
        "What 'list' shows: 'readable' = only keys the user may READ (admins see all); 'all' ="
        " every key, as in Storm.",
    ),
    Option(
        "master.max.calls.per.client",
        32,
        "Calls one user may have running at once on a master; more are refused with"
        " RESOURCE_EXHAUSTED (masters themselves are exempt).",
    ),
    Option(
        "master.rpc.threads",
        64,
        "Threads serving calls on a master. Users' calls together may take all but a quarter"
        " of them, and their status checks half of that quarter; the rest stay for the other"
        " masters. A call beyond is refused at once as busy (RESOURCE_EXHAUSTED; clients"
        " retry), not queued out of sight.",
    ),
    Option(
        "master.stop.linger.secs",
        0.0,
        "After a leader stops (SIGTERM) and has handed leadership over, how long it keeps its"
        " ZooKeeper session before ending it, so that its successor's first writes come before"
        " the session's end reaches the other masters. The end removes three nodes (the"
        " master's membership, candidacy and /holders nodes; its replica nodes are persistent),"
        " so 0, the default, ends it at once. A follower's stop does not linger.",
    ),
    Option(
        "master.cpus",
        "",
        "CPUs this master's threads run on, written as Linux does (\"0\", \"0,2\", \"1-3\");"
        " empty = wherever the system puts them. A master's threads take turns on Python's"
        " interpreter lock, so it gains little from a second CPU, while each hand-off between"
        " threads on different CPUs is a cross-CPU wake-up (on a virtual machine, an exit to"
        " the host). Confined to one CPU, a leader took about a quarter less CPU per small"
        " create (see the benchmark notes). Applied by 'blobha serve' at start; the local"
        " cluster gives each master one CPU.",
    ),
    Option(
        "master.request.receive.secs",
        10.0,
        "Seconds a master waits for a call's request message once its headers have come and"
        " the caller is admitted (it is authenticated from the headers, before the message);"
        " a call whose message has not come by then is ended (DEADLINE_EXCEEDED), so that"
        " calls that never send it cannot hold the master's call threads.",
    ),
    Option(
        "master.max.streams.per.connection",
        64,
        "Concurrent gRPC streams one client connection may open (grpc.max_concurrent_streams).",
    ),
    Option("audit.file", "", "Also append the audit log (blobha.audit) to this file."),
    Option(
        "metrics.listen",
        "",
        "host:port of this master's HTTP server for Prometheus metrics (/metrics) and the status"
        " page (/, /status.json). Empty: no HTTP server.",
    ),
    Option("log.level", "INFO", "Logging level: DEBUG, INFO, WARNING or ERROR."),
    Option(
        "log.format",
        "text",
        "Log line format: 'text' (human-readable) or 'json' (one object per line), both with"
        " the request id of the RPC being served.",
    ),
)

_BY_KEY = {o.key: o for o in OPTIONS}


@dataclass(frozen=True)
class Config:
    """A validated master configuration. Build one with :func:`load_config` or :meth:`of`."""

    values: Mapping[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    @classmethod
    def of(cls, overrides: Mapping[str, Any] | None = None) -> Config:
        merged = {o.key: o.default for o in OPTIONS}
        for k, v in (overrides or {}).items():
            if k not in _BY_KEY:
                raise ConfigError(f"unknown configuration key {k!r}; see 'blobha serve --help'")
            merged[k] = v
        return cls(_validate(merged))

    # Typed accessors for the keys the code uses most.
    @property
    def data_dir(self) -> Path:
        return Path(self.values["blobstore.dir"])

    @property
    def advertise(self) -> str:
        return str(self.values["master.advertise"])

    @property
    def metrics_listen(self) -> str:
        """host:port of the metrics and status HTTP server; '' when disabled."""
        return str(self.values["metrics.listen"])

    @property
    def admins(self) -> frozenset[str]:
        return frozenset(self.values["admins"])


def _flatten(prefix: str, table: Mapping[str, Any], out: dict[str, Any]) -> None:
    for k, v in table.items():
        name = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict) and name not in _BY_KEY:
            _flatten(name, v, out)
        else:
            out[name] = v


def data_port(setting: int | str, grpc_port: int, grpc_port_asked: int) -> int:
    """The data channel's port from ``blobstore.data.port``: as given, or the gRPC port plus
    the offset (a free port when the gRPC port itself was any free one, ``grpc_port_asked``
    0: an offset from a random port would hit anything)."""
    if isinstance(setting, str):
        return grpc_port + int(setting[1:]) if grpc_port_asked else 0
    return setting


def env_name(key: str) -> str:
    return "BLOBHA_" + key.upper().replace(".", "_")


def load_config(
    path: str | os.PathLike[str] | None, env: Mapping[str, str] | None = None
) -> Config:
    """Read ``path`` (may be None), apply ``BLOBHA_*`` environment overrides, validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                _flatten("", tomllib.load(f), raw)
        except FileNotFoundError:
            raise ConfigError(f"configuration file {os.fspath(path)!r} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(
                f"configuration file {os.fspath(path)!r} is not valid TOML: {e}"
            ) from None
    env = os.environ if env is None else env
    for option in OPTIONS:
        text = env.get(env_name(option.key))
        if text is not None:
            raw[option.key] = _from_env(option, text)
    return Config.of(raw)


def _from_env(option: Option, text: str) -> Any:
    if isinstance(option.default, list):
        return [t.strip() for t in text.split(",") if t.strip()]
    return text  # converted and checked by _validate


def _validate(v: dict[str, Any]) -> dict[str, Any]:
    def number(key: str, kind: type, minimum: float) -> None:
        value = v[key]
        try:
            converted = settings.whole(value) if kind is int else settings.real(value)
        except settings.SettingError:
            raise ConfigError(
                f"{key} must be a {'whole ' if kind is int else ''}number, got {value!r}"
            ) from None
        if converted < minimum:
            raise ConfigError(f"{key} must be at least {minimum}, got {value!r}")
        v[key] = converted

    def flag(key: str) -> None:
        try:
            v[key] = settings.flag(v[key])
        except settings.SettingError:
            raise ConfigError(f"{key} must be true or false, got {v[key]!r}") from None

    number("blobstore.replication.factor", int, 1)
    number("blobstore.write.quorum", int, 1)
    number("blobstore.write.timeout.secs", float, 0.1)
    number("blobstore.upload.expiration.secs", int, 1)
    number("blobstore.upload.max.per.user", int, 0)
    number("blobstore.disk.reserved.bytes", int, 0)
    number("blobstore.keys.max", int, 0)
    for quota in ("keys", "bytes", "acl.bytes", "upload.bytes"):
        number(f"blobstore.quota.user.{quota}", int, 0)
    number("auth.job.token.max.per.user", int, 0)
    number("blobstore.sync.period.secs", float, 0.1)
    number("blobstore.sync.periodic.keys.per.sec", int, 1)
    number("blobstore.replica.grace.secs", float, 0)
    number("blobstore.delete.grace.secs", float, 0)
    number("blobstore.versions.retained", int, 1)
    number("blobstore.sync.threads", int, 1)
    number("blobstore.sync.linger.secs", float, 0)
    # Below a second, a peer merely busy for a moment (a garbage collection, a disk sync)
    # would count as stalled and its fetches be thrown away.
    number("blobstore.sync.stall.secs", float, 1.0)
    number("blobstore.read.cutoff.secs", float, 0)
    number("blobstore.scrub.interval.secs", float, 0)
    number("blobstore.scrub.rate.bytes.per.sec", int, 0)
    number("zookeeper.session.timeout.ms", int, 1000)
    number("auth.job.token.max.lifetime.secs", int, 1)
    number("blobstore.peer.grant.secs", float, 1)
    number("blobstore.peer.holder.secs", float, 1)
    flag("blobstore.sync.recursive.watch")
    flag("blobstore.write.forward")
    data_port = v["blobstore.data.port"]
    if isinstance(data_port, str) and data_port.strip().startswith("+"):
        offset = data_port.strip()[1:]
        if not offset.isdigit() or not 1 <= int(offset) <= 1000:
            raise ConfigError(f"blobstore.data.port as an offset from the gRPC port is +1 to"
                              f" +1000, got {data_port!r}")
        v["blobstore.data.port"] = f"+{int(offset)}"
    else:
        number("blobstore.data.port", int, -1)
        if v["blobstore.data.port"] > 65535:
            raise ConfigError(f"blobstore.data.port must be a port, +N (the gRPC port plus N),"
                              f" 0 (any free one) or -1 (none), got {v['blobstore.data.port']}")

    for key in ("blobstore.dir", "zookeeper.servers", "master.listen", "master.principal"):
        if not isinstance(v[key], str) or not v[key].strip():
            raise ConfigError(f"{key} must be a non-empty string, got {v[key]!r}")
    for server in v["zookeeper.servers"].split(","):
        _check_hostport("zookeeper.servers", server.strip(), allow_no_port=True)
    chroot = v["zookeeper.chroot"]
    bad_end = isinstance(chroot, str) and chroot.endswith("/") and chroot != "/"
    if not isinstance(chroot, str) or not chroot.startswith("/") or bad_end:
        raise ConfigError(f"zookeeper.chroot must be an absolute path like /blobha, got {chroot!r}")
    _check_hostport("master.listen", v["master.listen"])
    if not v["master.advertise"]:
        host, port = v["master.listen"].rsplit(":", 1)
        wildcard = host in ("", "0.0.0.0", "::", "[::]")
        v["master.advertise"] = f"{'127.0.0.1' if wildcard else host}:{port}"
    _check_hostport("master.advertise", v["master.advertise"])
    if v["master.advertise"].rsplit(":", 1)[0] in ("0.0.0.0", "::", "[::]"):
        raise ConfigError("master.advertise must be an address others can reach, not a wildcard")
    admins = v["admins"]
    if not isinstance(admins, list) or not all(isinstance(a, str) and a for a in admins):
        raise ConfigError(f"admins must be a list of user names, got {admins!r}")
    _validate_security(v)
    number("master.max.calls.per.client", int, 1)
    number("master.max.streams.per.connection", int, 1)
    number("master.rpc.threads", int, 4)
    number("master.request.receive.secs", float, 0.1)
    number("master.stop.linger.secs", float, 0)
    if not isinstance(v["master.cpus"], str):
        raise ConfigError(f"master.cpus must be a CPU list like \"0\" or \"0,2-3\", got"
                          f" {v['master.cpus']!r}")
    v["master.cpus"] = format_cpu_list(parse_cpu_list(v["master.cpus"]))
    level = str(v["log.level"]).upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ConfigError(
            f"log.level must be DEBUG, INFO, WARNING or ERROR, got {v['log.level']!r}"
        )
    v["log.level"] = level
    metrics = v["metrics.listen"]
    if not isinstance(metrics, str):
        raise ConfigError(f"metrics.listen must be host:port or empty, got {metrics!r}")
    if metrics.strip():
        _check_hostport("metrics.listen", metrics.strip())
        if metrics.strip() == v["master.listen"]:
            raise ConfigError("metrics.listen must differ from master.listen (the gRPC port)")
    v["metrics.listen"] = metrics.strip()
    fmt = str(v["log.format"]).lower()
    if fmt not in ("text", "json"):
        raise ConfigError(f"log.format must be 'text' or 'json', got {v['log.format']!r}")
    v["log.format"] = fmt
    return v


def _validate_security(v: dict[str, Any]) -> None:
    for key in ("auth.token.file", "tls.cert", "tls.key", "tls.ca", "zookeeper.auth.file",
                "audit.file"):
        if not isinstance(v[key], str):
            raise ConfigError(f"{key} must be a file path (a string), got {v[key]!r}")
    mode = v["auth.mode"]
    if mode not in MODES:
        raise ConfigError(f"auth.mode must be 'simple', 'token' or 'mtls', got {mode!r}")
    if mode == AuthMode.TOKEN and not v["auth.token.file"]:
        raise ConfigError("auth.mode 'token' needs auth.token.file (make lines with"
                          " 'blobha token create')")
    rules = v["auth.mtls.rules"]
    if not isinstance(rules, list) or not all(isinstance(r, str) for r in rules):
        raise ConfigError(f"auth.mtls.rules must be a list of strings, got {rules!r}")
    if bool(v["tls.cert"]) != bool(v["tls.key"]):
        raise ConfigError("tls.cert and tls.key go together: set both or neither")
    if mode == AuthMode.MTLS and not (v["tls.cert"] and v["tls.ca"]):
        raise ConfigError("auth.mode 'mtls' needs TLS: set tls.cert, tls.key and tls.ca")
    if v["tls.ca"] and not v["tls.cert"]:
        raise ConfigError("tls.ca is set but tls.cert/tls.key are not; a master serves TLS only"
                          " with its own certificate")
    if v["zookeeper.auth.scheme"] not in ("none", "digest"):
        raise ConfigError(f"zookeeper.auth.scheme must be 'none' or 'digest', got"
                          f" {v['zookeeper.auth.scheme']!r}")
    if v["zookeeper.auth.scheme"] == "digest" and not v["zookeeper.auth.file"]:
        raise ConfigError("zookeeper.auth.scheme 'digest' needs zookeeper.auth.file (one"
                          " 'user:password' line)")
    if v["zookeeper.auth.scheme"] == "digest" and v["zookeeper.chroot"] == "/":
        raise ConfigError("zookeeper.auth.scheme 'digest' needs a zookeeper.chroot below /: the"
                          " lock-down never touches ZooKeeper's own root")
    _validate_zookeeper_tls(v)
    if v["blobstore.list.visibility"] not in ("readable", "all"):
        raise ConfigError(f"blobstore.list.visibility must be 'readable' or 'all', got"
                          f" {v['blobstore.list.visibility']!r}")


def _validate_zookeeper_tls(v: dict[str, Any]) -> None:
    for key in ("zookeeper.ssl.enabled", "zookeeper.ssl.verify.hostname"):
        try:
            v[key] = settings.flag(v[key])
        except settings.SettingError:
            raise ConfigError(f"{key} must be true or false, got {v[key]!r}") from None
    files = ("zookeeper.ssl.ca", "zookeeper.ssl.cert", "zookeeper.ssl.key")
    for key in files:
        if not isinstance(v[key], str):
            raise ConfigError(f"{key} must be a file path (a string), got {v[key]!r}")
    if bool(v["zookeeper.ssl.cert"]) != bool(v["zookeeper.ssl.key"]):
        raise ConfigError("zookeeper.ssl.cert and zookeeper.ssl.key go together: set both or"
                          " neither")
    named = [key for key in files if v[key]]
    if named and not v["zookeeper.ssl.enabled"]:
        # Files set but TLS off would look secure and send everything in clear.
        raise ConfigError(f"{named[0]} is set but zookeeper.ssl.enabled is false; set it to"
                          " true to reach ZooKeeper over TLS (or unset the zookeeper.ssl files)")


def parse_cpu_list(text: str) -> frozenset[int]:
    """CPU numbers from a list as Linux writes them (``"0,2-3"``); empty = none named.
    Raises :class:`ConfigError` naming ``master.cpus``."""
    cleaned = text.replace(" ", "")
    if not cleaned:
        return frozenset()
    cpus: set[int] = set()
    for part in cleaned.split(","):
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ConfigError(f"master.cpus must be a CPU list like \"0\" or \"0,2-3\","
                              f" got {text!r}")
        low, high = int(first), int(last) if dash else int(first)
        if high < low:
            raise ConfigError(f"master.cpus has a range that runs backwards ({part!r})")
        cpus.update(range(low, high + 1))
    return frozenset(cpus)


def format_cpu_list(cpus: Iterable[int]) -> str:
    """The shortest list :func:`parse_cpu_list` reads back as ``cpus``: ``"0,2-3"``."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and runs[-1][1] == cpu - 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _check_hostport(key: str, text: str, allow_no_port: bool = False) -> None:
    if ":" not in text:
        if allow_no_port and text:
            return
        raise ConfigError(f"{key} must be host:port, got {text!r}")
    host, port = text.rsplit(":", 1)
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{key} must be host:port with a port from 1 to 65535, got {text!r}")
