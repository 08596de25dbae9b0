#!/usr/bin/env bash
# Every GPU check in one call, for a GPU lent for minutes (run from the repo root, one GPU):
#
#   bash benchmarks/gpu_checks.sh [RESULTS_FOLDER]        # about 8 minutes; each check has its own time limit
#
# 1. the GPU tests (tests/test_gpu.py; they skip without a GPU),
# 2. throughput and MFU of gpt2 124M, bf16-mixed, compiled (benchmarks/gpu_throughput.py),
# 3. the fixed cost of a step: cohort fit against a hand-written loop, bf16-mixed on the GPU, at the debug size
#    (the fixed cost alone) and at the quickstart's size with a micro batch of 16 and no accumulation
#    (benchmarks/lightning_overhead.py --accelerator gpu).
# The pipeline's speed needs a GPU per stage, so it is not among them on one GPU.
# Each check's whole output is kept in RESULTS_FOLDER (default gpu_results; $OUT on the device tool's machine),
# for benchmarks/RESULTS.md. A machine without jsonargparse (which LightningCLI needs) installs the wheels in .whl/
# first: pip download --no-deps --only-binary=:all: -d .whl jsonargparse docstring-parser typeshed-client
set -u
results=${1:-${OUT:-gpu_results}}
mkdir -p "$results"
export PYTHONUNBUFFERED=1
if ! python3 -c "import jsonargparse" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$results/gpu.txt"
python3 -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__)" \
    | tee -a "$results/gpu.txt"

check() {  # check NAME SECONDS COMMAND...: run it, keep its output, print its end
    local name=$1 seconds=$2
    shift 2
    echo "== $name: $*"
    timeout "$seconds" "$@" >"$results/$name.txt" 2>&1
    echo "   exit $? ($name)"
    tail -n 15 "$results/$name.txt"
}

check tests 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py
check throughput 180 python3 -m benchmarks.gpu_throughput --steps 30
check overhead_debug 90 python3 -m benchmarks.lightning_overhead --accelerator gpu --model debug \
    --sequence-length 64 --global-batch-size 16 --micro-batch-size 16 --steps 100 --repeats 2
check overhead_small 90 python3 -m benchmarks.lightning_overhead --accelerator gpu --model small \
    --global-batch-size 16 --micro-batch-size 16 --steps 60 --repeats 2
