#!/usr/bin/env bash
# The checks that need a GPU, as one command for a machine that has one and already holds
# torch, pandas, matplotlib, pytest and pytest-timeout (nothing is installed or fetched):
#   bash scripts/gpu_checks.sh
# It runs every test that skips without CUDA: watch()'s host synchronisations under
# torch.cuda.set_sync_debug_mode("error") (tests/test_cuda.py) and ddp_verify's CUDA
# fingerprints and CUDA model (tests/test_ddp_verify.py), watch on FSDP2 over NCCL
# (tests/test_sharded.py, 2 GPUs). NCCL needs one GPU per rank: on
# a machine of one GPU its multi-rank path cannot run. Prints what it ran; exit status is
# pytest's (5, no tests collected, is turned into a failure); 3 where there is no CUDA device.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
"$PY" - <<'PYEOF' || { echo "gpu_checks: no CUDA device here, nothing to check" >&2; exit 3; }
import sys, torch
print("torch", torch.__version__, "| cuda", torch.version.cuda, "| devices", torch.cuda.device_count(),
      "|", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device")
sys.exit(0 if torch.cuda.is_available() else 3)
PYEOF
"$PY" -m pytest -q -rA -p no:cacheprovider tests/test_cuda.py tests/test_ddp_verify.py tests/test_sharded.py -k "cuda" "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
    echo "gpu_checks: pytest collected no tests" >&2
    exit 1
fi
exit "$rc"
