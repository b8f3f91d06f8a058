"""`tandem selftest`: one command that checks a machine and prints a report (JSON with `--json PATH`).

Owns the checks and their report: the header (torch, device, CUDA capability, triton), the attention
kernels against the torch reference paths, greedy agreement with transformers on tiny checkpoints it
builds (float32 and bfloat16), decode ms/step at batch 1/8/64 against the weight-read floor, prefill
TFLOP/s against bare matmuls of the same shapes, the memory plan, and the GB/s of each available KV
transport against a copy of the same bytes on the device. On CPU it runs the CPU subset; on a GPU machine
it is the one command that validates everything.

Runs in the user's process (`tandem selftest` or `python -m cluster.selftest`), with no Ray: the transfer
checks spawn their own peer process through `kv_transfer.bench`. Every check catches its own exception
(FAIL, with a short traceback in the JSON) and the command goes on; a check whose needs are missing is SKIP
with the reason. Exit code 0 only when no check failed.

    command.py   options (`--device`, `--json`, `--quick`) and the run over the checks
    checks.py    which checks run, and the runner that turns each into a CheckResult
    context.py   what checks share: device, checkpoints built once, the measured engine
    kernels.py, greedy.py, perf.py, transfer.py    the checks
    report.py    the header, the table, the JSON
    results.py   CheckResult, Outcome (frozen)

Imports cluster.bench (checkpoints, limits) and kv_transfer.bench; nothing imports it but the entry points.
"""
