#!/usr/bin/env bash
# The wheels `make gpu-check WHEELS=DIR` installs on a GPU host without network that has torch, triton,
# transformers, numpy and aiohttp but not the rest: Ray 2.60 trimmed of its Java jar and of the Ray libraries
# Tandem does not use (about 40 MiB instead of 79), gRPC and protobuf with the health and reflection services,
# jsonschema (Ray's), msgpack, prometheus-client, pytest-xdist, gguf (the GGUF tests write their files with it) and
# llguidance (structured outputs; its wheel needs glibc >= 2.31). Run it on a machine with network, for the GPU
# host's Python (default 3.12, x86-64 Linux).   usage: deploy/pack_gpu_wheels.sh DIR [PYTHON_VERSION]
set -euo pipefail
DIR=${1:?usage: deploy/pack_gpu_wheels.sh DIR [PYTHON_VERSION]}; PYVER=${2:-3.12}
mkdir -p "$DIR"; TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
PLATFORM=(--only-binary=:all: --python-version "$PYVER" --implementation cp --platform manylinux_2_31_x86_64
          --platform manylinux_2_28_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps "${PLATFORM[@]}" -d "$TMP" "ray==2.60.0"
python3 -m pip download -q --no-deps "${PLATFORM[@]}" -d "$DIR" grpcio==1.85.1 protobuf==7.35.1 \
  grpcio-reflection==1.85.1 grpcio-health-checking==1.85.1 jsonschema jsonschema-specifications referencing rpds-py \
  msgpack prometheus-client pytest-xdist execnet gguf "llguidance>=1.9,<2"
python3 - "$TMP"/ray-*.whl "$DIR" <<'PY'
"""Copy the Ray wheel without the folders Tandem never imports, and without their lines in its RECORD."""
import os
import sys
import zipfile

source, out = sys.argv[1], sys.argv[2]
dropped = ("ray/jars/", "ray/rllib/", "ray/tune/", "ray/train/", "ray/data/", "ray/llm/", "ray/dashboard/client/")
with zipfile.ZipFile(source) as wheel_in, \
        zipfile.ZipFile(os.path.join(out, os.path.basename(source)), "w", zipfile.ZIP_DEFLATED) as wheel_out:
    for info in wheel_in.infolist():
        if info.filename.startswith(dropped):
            continue
        data = wheel_in.read(info.filename)
        if info.filename.endswith(".dist-info/RECORD"):
            kept = [line for line in data.decode().splitlines() if not line.startswith(dropped)]
            data = "".join(line + "\n" for line in kept).encode()
        wheel_out.writestr(info, data, compress_type=info.compress_type)
PY
du -sh "$DIR"
