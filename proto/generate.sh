#!/usr/bin/env bash
# Regenerates proto/tandem_pb2.py and proto/tandem_pb2_grpc.py from proto/tandem.proto.
# Needs grpcio-tools in the active Python; run from anywhere.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python}"
cd "$root"
"$python" -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. proto/tandem.proto
# protoc writes `from proto import tandem_pb2` only when the -I root is the repo root (as above);
# make sure the grpc stub imports the message module as a package module either way.
sed -i -E 's/^import tandem_pb2 as/from proto import tandem_pb2 as/' proto/tandem_pb2_grpc.py
