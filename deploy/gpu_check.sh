#!/usr/bin/env bash
# `make gpu-check`: everything a GPU host should show, each step under its own timeout and all of it inside
# GPU_CHECK_BUDGET_S (default 470 s, under 8 minutes), then a Markdown report (OUT/report.md) with the card, the
# versions, every command and its numbers, ready to paste into docs/benchmarks.md.
#   usage, from the repository root:  deploy/gpu_check.sh OUT [WHEELS]
# Needs python3 with torch (CUDA) and triton. WHEELS: a folder of wheels for the rest (grpcio, protobuf, Ray...),
# installed into a private site folder first, for a host without network (deploy/pack_gpu_wheels.sh builds it).
# GPU_CHECK_STEPS: the steps to run, comma-separated (default all: selftest,bench-engine,bench-memory,
# bench-transfer,serve-1p1d,pytest); on a one-H100 lease the suite alone takes most of 8 minutes, so a session
# may run the benchmarks in one call and GPU_CHECK_STEPS=pytest in the next. Not in the default list:
# bench-engine-eager, the same benchmark with prefill and mixed steps eager (no piecewise graphs), to compare;
# bench-structured, a decode step with every row under a JSON schema against the same rows free (issue 30).
# GPU_CHECK_PYTEST_S: the suite's own timeout (default 240 s).
set -u
OUT=${1:?usage: deploy/gpu_check.sh OUT [WHEELS]}; WHEELS=${2:-}
BUDGET=${GPU_CHECK_BUDGET_S:-470}
STEPS=",${GPU_CHECK_STEPS:-selftest,bench-engine,bench-memory,bench-transfer,serve-1p1d,pytest},"
PY=${PYTHON:-python3}
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
: > "$OUT/steps.tsv"
if [ -n "$WHEELS" ]; then
  SITE=$(mktemp -d)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl \
    > "$OUT/pip.log" 2>&1 || echo "pip install from $WHEELS failed: see pip.log" >&2
  export PYTHONPATH="$SITE:$PWD"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
T0=$(date +%s)

# step NAME TIMEOUT_S COMMAND...: runs COMMAND (stdout and stderr to OUT/NAME.log) under the smaller of its
# timeout and what is left of the budget, and records name, exit status, seconds and the command.
step() {
  local name=$1 limit=$2; shift 2
  [[ "$STEPS" == *",$name,"* ]] || return 0  # not asked for: not run, not reported
  local left=$(( BUDGET - ($(date +%s) - T0) ))
  if [ "$left" -lt 15 ]; then
    printf '%s\tskipped\t0\t%s\n' "$name" "$*" >> "$OUT/steps.tsv"; return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local start=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - start ))" "$*" >> "$OUT/steps.tsv"
  echo "== $name rc=$rc after $(( $(date +%s) - T0 )) s"
}

"$PY" - > "$OUT/env.txt" 2>&1 <<'PY'
import platform, subprocess
import torch
print("python:", platform.python_version())
print("torch:", torch.__version__, "CUDA", torch.version.cuda)
for index in range(torch.cuda.device_count()):
    props = torch.cuda.get_device_properties(index)
    print(f"card {index}: {props.name}, {props.total_memory / 2**30:.1f} GiB")
for name in ("triton", "transformers", "ray", "grpc"):
    try:
        print(f"{name}:", __import__(name).__version__)
    except Exception as exc:
        print(f"{name}: missing ({type(exc).__name__})")
try:
    print("commit:", subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip())
except OSError:
    pass
PY

step selftest 170 "$PY" -m cluster.selftest --json "$OUT/selftest.json"
step bench-engine 100 "$PY" -m cluster.cli bench engine --shape qwen2.5-0.5b --device cuda --dtype bfloat16 \
  --skip-transformers --profile-steps --json "$OUT/bench_engine.json"
step bench-engine-eager 70 "$PY" -m cluster.cli bench engine --shape qwen2.5-0.5b --device cuda --dtype bfloat16 \
  --skip-transformers --mixed-graph-max-tokens 0 --json "$OUT/bench_engine_eager.json"
step bench-structured 90 "$PY" -m cluster.cli bench structured --batch 32 --rounds 2 --ttft-repeats 3
step bench-memory 90 "$PY" -m cluster.cli bench memory --json "$OUT/memory.json"
# one layer: 64 KiB blocks, so the 64 KiB transfer shows the fixed cost and the sizes above it the per-byte rate
step bench-transfer 40 "$PY" -m kv_transfer.bench --transport ipc --num-layers 1 --sizes-mib 0.0625,1,4,16,64 \
  --json "$OUT/transfer.json"
if "$PY" -c "import ray" 2>/dev/null; then
  step serve-1p1d 150 "$PY" deploy/gpu_serve_smoke.py --out "$OUT"
else
  [[ "$STEPS" == *",serve-1p1d,"* ]] && \
    printf 'serve-1p1d\tskipped (no ray)\t0\t%s\n' "deploy/gpu_serve_smoke.py --out $OUT" >> "$OUT/steps.tsv"
fi
# -n 4 (-n 8 on a host of 16 cores or more) where pytest-xdist is there: each engine on CUDA takes a small KV pool
WORKERS=$(( $(nproc) >= 16 ? 8 : 4 ))
PARALLEL=(); "$PY" -c "import xdist" 2>/dev/null && PARALLEL=(-n "$WORKERS")
# -v: each test's result is in the log as it ends, so a step cut by its timeout still names what failed;
# --timeout (pytest-timeout, where installed): one hung test does not take the step's whole time.
"$PY" -c "import pytest_timeout" 2>/dev/null && PARALLEL+=(--timeout 120)
step pytest "${GPU_CHECK_PYTEST_S:-240}" "$PY" -m pytest -v -p no:cacheprovider -p no:benchmark "${PARALLEL[@]}" --durations 20 \
  tests/engine tests/kv_transfer -rfE

"$PY" deploy/gpu_check_report.py "$OUT" > "$OUT/report.md"
echo "report: $OUT/report.md ($(( $(date +%s) - T0 )) s in all)"
