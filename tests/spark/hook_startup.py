"""How much ``blobha-python`` adds to a warm Python worker start: ``blobha-python -c pass``
against ``python -c pass``, with three code blobs already in the node cache. A measurement
to run by hand (``python tests/spark/hook_startup.py``), not a test: timings on a shared
machine are no pass/fail criterion."""

from __future__ import annotations

import io
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from support.clusters import running_cluster

from blobha.client import Client
from blobha.spark.jobcode import CodeFile, upload_code
from blobha.spark.settings import SparkBlobSettings

RUNS = 30


def _files(root: Path) -> list[CodeFile]:
    with zipfile.ZipFile(root / "lib.zip", "w") as z:
        z.writestr("m.py", "X = 1\n")
    (root / "f.txt").write_text("x")
    with tarfile.open(root / "data.tgz", "w:gz") as t:
        info = tarfile.TarInfo("a/b.txt")
        info.size = 1
        t.addfile(info, io.BytesIO(b"x"))
    return [CodeFile(str(root / "lib.zip"), "pyfile", "lib.zip"),
            CodeFile(str(root / "f.txt"), "file", "f.txt"),
            CodeFile(str(root / "data.tgz"), "archive", "data")]


def _medians_ms(commands: list[list[str]], env: dict[str, str], cwd: Path) -> list[float]:
    # Taken in turn, so that a change in the machine's load weighs on each command alike.
    times: list[list[float]] = [[] for _ in commands]
    for _ in range(RUNS):
        for command, taken in zip(commands, times, strict=True):
            started = time.perf_counter()
            subprocess.run(command, env=env, cwd=cwd, check=True)
            taken.append(time.perf_counter() - started)
    return [statistics.median(taken) * 1000 for taken in times]


def _bytecode_note() -> str:
    # Without bytecode (PYTHONDONTWRITEBYTECODE=1 over an editable install, say) every start
    # compiles blobha's modules, which an installed wheel does not.
    import importlib.util

    import blobha.spark.worker as hook

    source = Path(hook.__file__)
    cached = Path(importlib.util.cache_from_source(str(source)))
    if cached.exists() and cached.stat().st_mtime >= source.stat().st_mtime:
        return "blobha's modules have bytecode"
    return "blobha's modules have no bytecode: every start compiles them"


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="blobha-hook-"))
    hook = str(Path(sys.executable).parent / "blobha-python")
    with running_cluster(root / "cluster") as c:
        with Client(c.cluster, user="bob") as client:
            specs = upload_code(client, "bob", _files(root))
        settings = SparkBlobSettings(cluster=c.cluster, user="bob", code=tuple(specs),
                                     cache_dir=str(root / "cache"), app_id="app-timing",
                                     update_interval_secs=600)
        env = {**os.environ, "BLOBHA_SPARK_CONF": settings.to_json(),
               "BLOBHA_PYSPARK_PYTHON": sys.executable}
        work = root / "work"
        work.mkdir()
        subprocess.run([hook, "-c", "pass"], env=env, cwd=work, check=True)  # cold: fetches
        plain, hooked = _medians_ms([[sys.executable, "-c", "pass"], [hook, "-c", "pass"]],
                                    env, work)
    print(f"python -c pass:        median {plain:.1f} ms")
    print(f"blobha-python -c pass: median {hooked:.1f} ms (warm, 3 code blobs)")
    print(f"added:                 {hooked - plain:.1f} ms; load average {os.getloadavg()[0]:.1f}")
    print(f"({_bytecode_note()})")


if __name__ == "__main__":
    main()
