"""Helpers shared by the tests/spark modules (imported by name: pytest puts this directory on
sys.path, and tests/integration/conftest.py is not visible from here, so the few helpers needed
are copied rather than imported)."""

from __future__ import annotations

import hashlib
import io
import os
import re
import shutil
import site
import subprocess
import sys
import tarfile
import textwrap
import threading
import zipfile
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import pytest

T = TypeVar("T")

EXAMPLES = Path(__file__).resolve().parents[2] / "deploy" / "examples"


def require_spark() -> None:
    """Skip the module when PySpark or Java is missing (the 'spark' extra is optional)."""
    pytest.importorskip("pyspark")
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("no Java runtime for Spark")


def spark_env(work: Path) -> dict[str, str]:
    """Environment every Spark JVM and Python worker of the tests needs: this interpreter
    (which has blobha installed) for the workers, and scratch space in a temp dir."""
    return {
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        "SPARK_LOCAL_DIRS": str(work / "local"),
    }


def spark_home() -> Path:
    home = os.environ.get("SPARK_HOME")
    if home:
        return Path(home)
    import pyspark

    return Path(pyspark.__file__).parent


def stop_session(spark: Any) -> None:
    """Stop the application, and remove what local-cluster workers keep of it (executor logs,
    fetched files) under <spark home>/work: inside site-packages for pip's pyspark, and no
    setting moves it."""
    sc = spark.sparkContext
    if getattr(sc, "_jsc", None) is None:
        return  # stopped already
    app_id, master = sc.applicationId, sc.master
    spark.stop()
    if (master or "").startswith("local-cluster"):
        shutil.rmtree(spark_home() / "work" / app_id, ignore_errors=True)


#: Conf that keeps test JVMs small and quiet.
QUIET_CONF: dict[str, str] = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "4",
    "spark.driver.memory": "768m",
    "spark.executor.memory": "768m",
}


def new_session(master: str, name: str, **conf: str) -> Any:
    from pyspark.errors import PySparkRuntimeError
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.master(master).appName(name)
    for k, v in {**QUIET_CONF, **conf}.items():
        builder = builder.config(k, v)
    for attempt in range(3):
        try:
            spark = builder.getOrCreate()
            break
        except PySparkRuntimeError as e:
            # The JVM gateway is started by fork+exec from this process, which has gRPC's
            # threads running; on a loaded machine the child occasionally dies before the JVM
            # starts ("Java gateway process exited"). That is the test process's environment,
            # not blobha under test: start it again, a bounded number of times.
            if "JAVA_GATEWAY_EXITED" not in str(e) or attempt == 2:
                raise
            print(f"Spark's gateway did not start ({e}); starting it again", file=sys.stderr)
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def env_archive(root: Path) -> Path:
    """A virtual environment packed as Spark users pack one (venv-pack, conda-pack): a copied
    interpreter, and a module found nowhere else. PySpark and blobha come from this test's
    environment through a .pth file (a real one would install them)."""
    env = root / "envsrc"
    subprocess.run([sys.executable, "-m", "venv", "--copies", "--without-pip", str(env)],
                   check=True)
    purelib = next(env.glob("lib/python*/site-packages"))
    (purelib / "envonly.py").write_text("VALUE = 1000\n")
    ours = [p for p in site.getsitepackages() if p.startswith(sys.prefix)]
    (purelib / "outer.pth").write_text(
        "".join(f"import site; site.addsitedir({p!r})\n" for p in ours))
    archive = root / "env.tgz"
    with tarfile.open(archive, "w:gz") as t:
        for path in sorted(env.rglob("*")):
            if "__pycache__" not in path.parts:
                t.add(path, arcname=str(path.relative_to(env)), recursive=False)
    return archive


def job_files(root: Path, job: str) -> dict[str, Path]:
    """The inputs of the job-code tests under ``root``: a zip holding ``jobhelper`` (for
    ``--py-files``), ``factor.txt`` (``--files``), ``data.tgz`` holding
    ``table/values.txt`` (``--archives``) and the job script ``job``."""
    root.mkdir(parents=True)
    lib = root / "libs.zip"
    with zipfile.ZipFile(lib, "w") as z:
        z.writestr("jobhelper.py", "def triple(x):\n    return 3 * x\n")
    factor = root / "factor.txt"
    factor.write_text("10")
    data = root / "data.tgz"
    with tarfile.open(data, "w:gz") as t:
        payload = b"1 2 3"
        info = tarfile.TarInfo("table/values.txt")
        info.size = len(payload)
        t.addfile(info, io.BytesIO(payload))
    script = root / "job.py"
    script.write_text(textwrap.dedent(job))
    return {"lib": lib, "factor": factor, "data": data, "job": script}


def command_lines() -> dict[int, str]:
    """Every process's command line on this machine (as ``ps`` shows it to any account)."""
    out: dict[int, str] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    line = f.read()
            except OSError:
                continue  # gone meanwhile
            out[int(entry.name)] = line.replace(b"\0", b" ").decode(errors="replace")
    return out


_JOB_TOKEN = re.compile(r"bjt1\.([0-9a-f]*)\.\S*")


class CommandLineWatch:
    """Reads every process's command line, over and over from a thread while in the ``with``
    block: ``exposed`` holds each one that showed ``needle`` (a job token shown by its id
    only), ``seen`` which of ``markers`` any command line held, ``scans`` how many passes."""

    def __init__(self, needle: str = "bjt1.",
                 markers: tuple[str, ...] = ("org.apache.spark.deploy.SparkSubmit",
                                             "CoarseGrainedExecutorBackend")) -> None:
        self.needle, self.markers = needle, markers
        self.exposed: dict[int, str] = {}
        self.seen: set[str] = set()
        self.scans = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        # Sampling, not waiting for anything: as often as a core allows without hogging it.
        while not self._stop.wait(0.02):
            for pid, line in command_lines().items():
                if self.needle in line:
                    # The program, then each word that shows the needle.
                    words = line.split()
                    shown = [_JOB_TOKEN.sub(r"bjt1.\1.<secret>", w)[:200]
                             for w in words if self.needle in w]
                    self.exposed[pid] = " ... ".join([words[0][-60:], *shown])
                self.seen.update(m for m in self.markers if m in line)
            self.scans += 1

    def __enter__(self) -> CommandLineWatch:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(30)
