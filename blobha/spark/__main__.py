"""``python -m blobha.spark ARGS``: the launcher, as ``blobha spark-submit ARGS``."""

from __future__ import annotations

import sys

from blobha.spark.submit import submit_main

if __name__ == "__main__":
    sys.exit(submit_main(sys.argv[1:]))
