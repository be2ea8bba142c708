#!/usr/bin/env bash
# Regenerates blobha/v1 from proto/. tests/unit/test_proto_fresh.py fails when they differ.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.}
python -m grpc_tools.protoc -Iproto --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
    proto/blobha/v1/blobha.proto
