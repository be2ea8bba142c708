"""What the launcher reads around spark-submit, the way spark-submit itself reads it: which
``spark-submit`` runs, the Spark conf it will see (``spark-defaults.conf``,
``--properties-file``, ``--conf``), the master and deploy mode, and which Python interpreter
the launcher may name. Loaded by the launcher only, never in a Spark worker."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

from blobha.core.errors import InvalidArgument
from blobha.spark.conf import CONF_PREFIX
from blobha.spark.settings import NotConfigured

__all__ = [
    "TAKES_VALUE",
    "SubmitArgs",
    "default_properties_file",
    "effective_conf",
    "find_spark_submit",
    "interpreter_env",
    "is_local_master",
    "properties_layer",
    "pyspark_submit_path",
    "read_properties",
    "scan_submit_args",
    "with_properties_file",
    "write_properties",
]

CONF_PYTHON = "spark.pyspark.python"
CONF_DRIVER_PYTHON = "spark.pyspark.driver.python"

#: spark-submit's options that take a value (SparkSubmitOptionParser, Spark 3.5 to 4.x).
TAKES_VALUE = frozenset({
    "--master", "--remote", "--deploy-mode", "--class", "--name", "--jars", "--packages",
    "--exclude-packages", "--repositories", "--py-files", "--files", "--archives",
    "--properties-file", "--extra-properties-file", "--driver-memory",
    "--driver-java-options", "--driver-library-path", "--driver-class-path",
    "--driver-default-class-path", "--executor-memory", "--proxy-user", "--driver-cores",
    "--total-executor-cores", "--executor-cores", "--num-executors", "--queue", "--principal",
    "--keytab", "--kill", "--status",
})
_CONF_FLAGS = ("--conf", "-c")


class SubmitArgs(NamedTuple):
    """spark-submit's arguments, read as spark-submit reads them."""

    #: ``--conf`` settings in order (a later one of the same key wins).
    confs: tuple[tuple[str, str], ...]
    #: The arguments to pass on: everything but the ``spark.blobha.*`` ``--conf`` settings.
    rest: tuple[str, ...]
    properties_file: str | None = None
    extra_properties_files: tuple[str, ...] = ()
    load_spark_defaults: bool = False
    master: str | None = None
    deploy_mode: str | None = None

    @property
    def blobha_confs(self) -> dict[str, str]:
        return {k: v for k, v in self.confs if k.startswith(CONF_PREFIX)}


def scan_submit_args(args: Sequence[str]) -> SubmitArgs:
    """Read spark-submit's options, and take the ``spark.blobha.*`` ``--conf`` settings out.

    Only the options before the application file are spark-submit's; what follows belongs to
    the application and is left alone.
    """
    confs: list[tuple[str, str]] = []
    rest: list[str] = []
    values: dict[str, str] = {}
    extra: list[str] = []
    load_defaults = False
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("-"):
            rest.extend(args[i:])  # the application and its own arguments
            break
        name, eq, inline = arg.partition("=")
        value: str | None
        if eq and name.startswith("--"):
            value, step = inline, 1
        elif arg in _CONF_FLAGS or arg in TAKES_VALUE:
            name = arg
            value, step = (args[i + 1], 2) if i + 1 < len(args) else (None, 1)
        else:
            name, value, step = arg, None, 1
        if name in _CONF_FLAGS and value is not None:
            key, _, v = value.partition("=")
            confs.append((key, v))
            if key.startswith(CONF_PREFIX):
                i += step
                continue  # the launcher passes the merged spark.blobha.* settings itself
        elif name == "--extra-properties-file" and value is not None:
            extra.append(value)
        elif name == "--load-spark-defaults":
            load_defaults = True
        elif value is not None:
            values[name] = value
        rest.extend(args[i : i + step])
        i += step
    return SubmitArgs(
        confs=tuple(confs),
        rest=tuple(rest),
        properties_file=values.get("--properties-file"),
        extra_properties_files=tuple(extra),
        load_spark_defaults=load_defaults,
        master=values.get("--master"),
        deploy_mode=values.get("--deploy-mode"),
    )


# --------------------------------------------------------------------------------------------
# Which spark-submit
# --------------------------------------------------------------------------------------------


def pyspark_submit_path() -> str:
    """The ``spark-submit`` script shipped in the installed pyspark package."""
    spec = importlib.util.find_spec("pyspark")
    if spec is None or not spec.submodule_search_locations:
        raise NotConfigured(
            "no spark-submit: set SPARK_HOME, put spark-submit on PATH, pip install"
            " 'blobha[spark]', or pass --spark-submit PATH"
        )
    home = Path(next(iter(spec.submodule_search_locations)))
    script = home / "bin" / "spark-submit"
    if not script.exists():
        raise NotConfigured(f"no spark-submit in {home}/bin; pass --spark-submit PATH")
    return str(script)


def find_spark_submit(explicit: str | None, env: Mapping[str, str]) -> str:
    """``--spark-submit PATH``, else ``$SPARK_HOME/bin/spark-submit``, else ``spark-submit``
    on ``PATH``, else the pyspark package's: the order a Spark user expects (an installed
    Spark distribution over the pip package's copy)."""
    if explicit:
        return explicit
    home = env.get("SPARK_HOME", "").strip()
    if home:
        script = Path(home) / "bin" / "spark-submit"
        if not script.is_file():
            raise NotConfigured(
                f"SPARK_HOME={home} has no bin/spark-submit: fix SPARK_HOME, unset it, or pass"
                " --spark-submit PATH"
            )
        return str(script)
    found = shutil.which("spark-submit", path=env.get("PATH", os.defpath))
    return found or pyspark_submit_path()


# --------------------------------------------------------------------------------------------
# The Spark conf spark-submit will see
# --------------------------------------------------------------------------------------------


def _spark_home_of(spark_submit: str) -> Path | None:
    # What spark-submit's own scripts take for SPARK_HOME when it is unset: the directory
    # above bin/, or for pip's entry script (bin/ beside find_spark_home.py) the package.
    script = Path(spark_submit)
    if not script.is_file():
        return None
    bin_dir = script.resolve().parent
    if (bin_dir / "find_spark_home.py").exists():
        spec = importlib.util.find_spec("pyspark")
        if spec is not None and spec.submodule_search_locations:
            return Path(next(iter(spec.submodule_search_locations)))
    return bin_dir.parent


def default_properties_file(env: Mapping[str, str], spark_submit: str) -> Path | None:
    """spark-defaults.conf as spark-submit finds it: in ``$SPARK_CONF_DIR``, else in
    ``$SPARK_HOME/conf`` (SPARK_HOME defaulting to the spark-submit's own home); None if
    there is no such file."""
    conf_dir = env.get("SPARK_CONF_DIR", "").strip()
    if conf_dir:
        base: Path | None = Path(conf_dir)
    else:
        home = env.get("SPARK_HOME", "").strip()
        spark_home = Path(home) if home else _spark_home_of(spark_submit)
        base = spark_home / "conf" if spark_home is not None else None
    if base is None:
        return None
    path = base / "spark-defaults.conf"
    return path if path.is_file() else None


_ESCAPES = {"t": "\t", "n": "\n", "r": "\r", "f": "\f"}


def _unescape(text: str) -> str:
    out: list[str] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text):
            n = text[i + 1]
            if n == "u" and re.fullmatch(r"[0-9a-fA-F]{4}", text[i + 2 : i + 6]):
                out.append(chr(int(text[i + 2 : i + 6], 16)))
                i += 6
                continue
            out.append(_ESCAPES.get(n, n))
            i += 2
            continue
        out.append(c)
        i += 1
    return "".join(out)


def _logical_lines(text: str) -> list[str]:
    lines: list[str] = []
    pending: str | None = None
    for raw in text.splitlines():
        line = raw.lstrip(" \t\f")
        if pending is None and (not line or line[0] in "#!"):
            continue
        if pending is not None:
            line = pending + line
        trailing = len(line) - len(line.rstrip("\\"))
        if trailing % 2 == 1:  # an odd count of backslashes continues the line
            pending = line[:-1]
            continue
        pending = None
        lines.append(line)
    if pending is not None:
        lines.append(pending)
    return lines


def read_properties(path: str | Path) -> dict[str, str]:
    """A Java properties file, read as Spark reads it (``java.util.Properties`` in UTF-8,
    values trimmed): ``key value``, ``key=value`` or ``key: value`` lines, ``#`` and ``!``
    comments, backslash continuations and escapes."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidArgument(
            f"cannot read the properties file {path}: {exc.strerror or exc}"
        ) from None
    out: dict[str, str] = {}
    for line in _logical_lines(text):
        # The key ends at the first unescaped '=', ':' or white space.
        m = re.match(r"((?:\\.|[^\\=:\s])*)[ \t\f]*(?:[=:][ \t\f]*)?(.*)", line, re.S)
        assert m is not None  # the pattern matches any line
        out[_unescape(m.group(1))] = _unescape(m.group(2)).strip()
    return out


def _escape(text: str, key: bool) -> str:
    out: list[str] = []
    for i, c in enumerate(text):
        if c == "\\":
            out.append("\\\\")
        elif c in "\n\r\t\f":
            out.append("\\" + "nrtf"["\n\r\t\f".index(c)])
        elif ord(c) < 0x20 or ord(c) == 0x7F:
            out.append(f"\\u{ord(c):04x}")
        elif (key and c in "=: #!") or (c == " " and i == 0):
            out.append("\\" + c)
        else:
            out.append(c)
    return "".join(out)


def write_properties(fd: int, entries: Mapping[str, str]) -> None:
    """``entries`` as a Java properties file, read back by :func:`read_properties` and by
    Spark (UTF-8) as they are, written to the open file ``fd``, which is closed."""
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        for key, value in entries.items():
            f.write(f"{_escape(key, True)}={_escape(value, False)}\n")


def properties_layer(
    submit: SubmitArgs, env: Mapping[str, str], spark_submit: str
) -> dict[str, str]:
    """The entries of the one properties file spark-submit reads: ``--properties-file``,
    else ``spark-defaults.conf`` (which a ``--properties-file`` replaces, so a file given in
    its stead must carry them)."""
    if submit.properties_file is not None:
        return read_properties(submit.properties_file)
    default = default_properties_file(env, spark_submit)
    return read_properties(default) if default is not None else {}


def with_properties_file(args: Sequence[str], path: str, keys: Iterable[str]) -> list[str]:
    """spark-submit's ``args`` reading the properties file ``path`` instead of any the user
    named, without their ``--conf`` settings of ``keys`` (a ``--conf`` would win over the
    file, as the launcher's own ``--conf`` used to win over the user's)."""
    ours = frozenset(keys)
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("-"):
            out.append("--properties-file")
            out.append(path)
            out.extend(args[i:])  # the application and its own arguments
            return out
        name, eq, inline = arg.partition("=")
        if eq and name.startswith("--"):
            value: str | None = inline
            step = 1
        elif arg in _CONF_FLAGS or arg in TAKES_VALUE:
            name, value, step = arg, (args[i + 1] if i + 1 < len(args) else None), 2
        else:
            name, value, step = arg, None, 1
        dropped = name == "--properties-file" or (
            name in _CONF_FLAGS and value is not None and value.partition("=")[0] in ours)
        if not dropped:
            out.extend(args[i : i + step])
        i += step
    return [*out, "--properties-file", path]


def effective_conf(
    submit: SubmitArgs, env: Mapping[str, str], spark_submit: str
) -> dict[str, str]:
    """The conf spark-submit will build, with Spark's precedence: ``--conf`` (a later one
    wins), then each ``--extra-properties-file`` (a later one wins), then
    ``--properties-file``, then ``spark-defaults.conf``, which a ``--properties-file``
    replaces entirely unless ``--load-spark-defaults`` is given (Spark 4.0 and later)."""
    conf: dict[str, str] = {}
    for extra in submit.extra_properties_files:
        conf.update(read_properties(extra))
    files: list[Path] = []
    if submit.properties_file is not None:
        files.append(Path(submit.properties_file))
    if submit.properties_file is None or submit.load_spark_defaults:
        default = default_properties_file(env, spark_submit)
        if default is not None:
            files.append(default)
    for path in files:
        for key, value in read_properties(path).items():
            conf.setdefault(key, value)
    conf.update(submit.confs)
    return conf


# --------------------------------------------------------------------------------------------
# The interpreter
# --------------------------------------------------------------------------------------------

_LOCAL_MASTER = re.compile(r"local(\[.*\])?|local-cluster\[.*\]", re.S)


def is_local_master(master: str) -> bool:
    """Whether every executor of ``master`` runs on this machine: ``local``, ``local[N]``,
    ``local[N,F]``, ``local[*]`` and ``local-cluster[N,C,M]``."""
    return _LOCAL_MASTER.fullmatch(master.strip()) is not None


def interpreter_env(
    submit: SubmitArgs, conf: Mapping[str, str], env: Mapping[str, str], launcher: str
) -> dict[str, str]:
    """The interpreter variables the launcher adds to spark-submit's environment.

    ``PYSPARK_PYTHON`` travels with every Python function to the executors, so the launcher's
    own interpreter (``launcher``, a path other nodes do not have) is named there only when
    the executors run on this machine (a ``local`` or ``local-cluster`` master) and the user
    chose none (``spark.pyspark.python`` or ``PYSPARK_PYTHON``). A client-mode driver runs
    here whatever the master, so it gets the launcher's interpreter, which has blobha, unless
    the user chose one for it; ``PYSPARK_DRIVER_PYTHON`` reaches no executor.
    """
    master = submit.master or conf.get("spark.master") or env.get("MASTER") or "local[*]"
    deploy_mode = (
        submit.deploy_mode or conf.get("spark.submit.deployMode") or env.get("DEPLOY_MODE")
        or "client"
    )
    added: dict[str, str] = {}
    python_chosen = bool(conf.get(CONF_PYTHON, "").strip() or env.get("PYSPARK_PYTHON"))
    if not python_chosen and is_local_master(master):
        added["PYSPARK_PYTHON"] = launcher
        python_chosen = True
    driver_chosen = python_chosen or bool(
        conf.get(CONF_DRIVER_PYTHON, "").strip() or env.get("PYSPARK_DRIVER_PYTHON")
    )
    if not driver_chosen and deploy_mode.strip() == "client":
        added["PYSPARK_DRIVER_PYTHON"] = launcher
    return added
