#!/usr/bin/env bash
# The GPU machine's whole job, in one prepared script (issue 31; benchmarks/gpu/README.md):
#   1. install what that machine lacks (taichi, dill) from the wheels in .whl/ (it has no network),
#   2. print `taifuse info`,
#   3. run the Taichi tests on ARCH (default cuda) under a time limit,
#   4. run `taifuse bench --quick` on taichi/ARCH against PyTorch on TORCH_DEVICE (default cuda) for
#      the elementwise, linear, optim and transformer suites (their device-resident cases), one
#      report per suite,
# writing every log and report into the folder named by the first argument.
#
# Dry run on a machine without a GPU (only the GPU is missing):
#   ARCH=cpu TORCH_DEVICE=cpu bash benchmarks/gpu/run.sh /tmp/gpu-dry
#
# Settings (environment): ARCH, TORCH_DEVICE, PYTHON (default python3), TESTS_TIMEOUT (s, 120),
# BENCH_TIMEOUT (s per suite, 180), TOTAL_LIMIT (s for the whole script, 420: no suite starts past
# it), TEST_WORKERS (pytest-xdist workers, 8), TEST_PATHS (default tests), PROCESSES (fresh
# processes per bench case, 2), SUITES (default: elementwise linear optim transformer).
# Each step runs under its own limit and a failing step does not stop the next: the exit status is
# that of the first step that failed (0 when all passed).
set -u
OUTDIR=${1:?usage: bash benchmarks/gpu/run.sh OUT_DIR}
ARCH=${ARCH:-cuda}
TORCH_DEVICE=${TORCH_DEVICE:-cuda}
PYTHON=${PYTHON:-python3}
TESTS_TIMEOUT=${TESTS_TIMEOUT:-120}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-180}
TOTAL_LIMIT=${TOTAL_LIMIT:-420}
TEST_WORKERS=${TEST_WORKERS:-8}
TEST_PATHS=${TEST_PATHS:-tests}
PROCESSES=${PROCESSES:-2}
SUITES=${SUITES:-elementwise linear optim transformer}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
cd "$ROOT"
status=0
step() { # step NAME STATUS: remember the first failure
    echo "== $1: exit $2 ($(date -u +%H:%M:%S))" | tee -a "$OUTDIR/steps.txt"
    if [ "$status" = 0 ] && [ "$2" != 0 ]; then status=$2; fi
}
started=$(date +%s)

# 1. Install taichi and dill (and expecttest, for the OpInfo tests) from carried wheels where they are missing (NOTE: --no-deps, and
#    into a folder of their own, so the image's numpy, rich and colorama stay as they are).
if ! "$PYTHON" -c "import taichi" >/dev/null 2>&1; then
    if ls .whl/*.whl >/dev/null 2>&1; then
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/taifuse-site .whl/*.whl 2>&1 | tail -3
        step install "${PIPESTATUS[0]}"
        export PYTHONPATH=/tmp/taifuse-site${PYTHONPATH:+:$PYTHONPATH}
    else
        echo "taichi is not installed and there is no .whl/ folder: see benchmarks/gpu/README.md"
        step install 1
    fi
fi
export PYTHONPATH=$ROOT/src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 TAIFUSE_BACKEND=taichi TAIFUSE_TAICHI_ARCH=$ARCH

# 2. What this machine is.
{
    date -u
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    "$PYTHON" -m taifuse.cli info
    "$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())" 2>&1
} 2>&1 | tee "$OUTDIR/info.txt"
step info "${PIPESTATUS[0]}"

# 3. The Taichi tests on ARCH (every backend-parametrised test's taichi-ARCH case, and the tests
#    that start Taichi on it), the run failing if none of them passed.
xdist=()
if [ "$TEST_WORKERS" != 0 ] && "$PYTHON" -c "import xdist" >/dev/null 2>&1; then xdist=(-n "$TEST_WORKERS"); fi
# one test that hangs (a kernel that never returns) must not eat the step: pytest-timeout where installed
if "$PYTHON" -c "import pytest_timeout" >/dev/null 2>&1; then xdist+=(--timeout 90); fi
timeout --signal=INT --kill-after=20 "$TESTS_TIMEOUT" \
    "$PYTHON" -m pytest -q -p no:cacheprovider "${xdist[@]}" -k "taichi-$ARCH" \
    --require-backend="taichi-$ARCH" --continue-on-collection-errors -rfE $TEST_PATHS 2>&1 | tee "$OUTDIR/tests.log" | tail -40
step "tests (limit ${TESTS_TIMEOUT}s)" "${PIPESTATUS[0]}"

# 4. The benchmarks: both sides on the device, synchronised around every timed sample. One run per
#    suite, each writing its own report (bench-SUITE/), so a suite cut off by the time limit loses
#    only itself; a suite is not started when less than 30 s of TOTAL_LIMIT is left.
for s in $SUITES; do
    left=$(( TOTAL_LIMIT - ($(date +%s) - started) ))
    limit=$(( left < BENCH_TIMEOUT ? left : BENCH_TIMEOUT ))
    if [ "$limit" -lt 30 ]; then
        echo "bench $s: not started, ${left}s of the ${TOTAL_LIMIT}s limit left" | tee -a "$OUTDIR/steps.txt"
        step "bench $s" 124
        continue
    fi
    timeout --signal=INT --kill-after=15 "$limit" \
        "$PYTHON" -m taifuse.cli bench --quick --processes "$PROCESSES" --no-progress --compare-torch \
        --torch-device "$TORCH_DEVICE" --suite "$s" --out "$OUTDIR/bench-$s" 2>&1 | tee "$OUTDIR/bench-$s.log"
    step "bench $s (limit ${limit}s)" "${PIPESTATUS[0]}"
done

echo "== done in $(( $(date +%s) - started )) s, status $status" | tee -a "$OUTDIR/steps.txt"
exit "$status"
