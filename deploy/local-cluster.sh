#!/usr/bin/env bash
# Quick start: set up (first run only) and run a local cluster of 3 masters with an embedded
# ZooKeeper, in the foreground. Extra arguments go to 'blobha local-cluster'.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh
exec .venv/bin/blobha local-cluster "$@"
