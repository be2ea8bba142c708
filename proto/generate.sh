#!/usr/bin/env bash
# Regenerates blobha/v1/ (blobha_pb2.py, .pyi, blobha_pb2_grpc.py) from proto/blobha/v1/blobha.proto
# with the virtualenv's grpcio-tools; run it after every change of the .proto, and commit both.
# tests/unit/test_project.py generates them again and fails when the committed files differ.
# Usage: proto/generate.sh [OUTPUT_DIR] (default: the checkout; the test passes a temp dir).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.}
python -m grpc_tools.protoc -Iproto --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
    proto/blobha/v1/blobha.proto
