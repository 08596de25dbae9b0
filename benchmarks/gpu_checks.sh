#!/usr/bin/env bash
# Every GPU check in one call, for a GPU lent for minutes (run from the repo root, one GPU):
#
#   bash benchmarks/gpu_checks.sh [RESULTS_FOLDER]   # at most 9.5 minutes: the checks' time limits add to 570 s
#
# 1. a GPU fit to its end: the final checkpoint, the monitor's CUDA series and charts in TensorBoard, the run summary
#    (benchmarks/gpu_fit_to_end.py; each of its checks is a row of the table),
# 2. the GPU tests (tests/test_gpu.py),
# 3. throughput and MFU of gpt2 124M, bf16-mixed, compiled (benchmarks/gpu_throughput.py),
# 4. the fixed cost of a step: cohort fit against a hand-written loop, bf16-mixed on the GPU, at the debug size
#    (the fixed cost alone) and at the quickstart's size with a micro batch of 16 and no accumulation
#    (benchmarks/lightning_overhead.py --accelerator gpu).
# The pipeline's speed needs a GPU per stage, so it is not among them on one GPU.
# It ends with one table of what held. Without a GPU it is a dry run: the GPU checks are skipped, with the reason, and
# the fit's checks run on the CPU (the CUDA ones skipped), which checks the checks themselves.
# Each check's whole output is kept in RESULTS_FOLDER (default gpu_results; $OUT on the device tool's machine),
# for benchmarks/RESULTS.md. A machine without jsonargparse (which LightningCLI needs) installs the wheels in .whl/
# first: pip download --no-deps --only-binary=:all: -d .whl jsonargparse docstring-parser typeshed-client
set -u
results=${1:-${OUT:-gpu_results}}
mkdir -p "$results"
table="$results/table.tsv"  # check, result, detail: one row per check
: >"$table"
export PYTHONUNBUFFERED=1
if ! python3 -c "import jsonargparse" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
no_gpu=$(python3 -c "import torch; print('' if torch.cuda.is_available() else 'no CUDA GPU visible to torch')")
if [ -z "$no_gpu" ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$results/gpu.txt"
fi
python3 -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__)" \
    | tee -a "$results/gpu.txt"

check() {  # check NAME SECONDS COMMAND...: run it on the GPU, keep its output, print its end, add its row
    local name=$1 seconds=$2
    shift 2
    if [ -n "$no_gpu" ]; then
        printf '%s\tskipped\t%s\n' "$name" "$no_gpu" >>"$table"
        return
    fi
    echo "== $name: $*"
    timeout "$seconds" "$@" >"$results/$name.txt" 2>&1
    local status=$?
    echo "   exit $status ($name)"
    tail -n 15 "$results/$name.txt"
    case $status in
        0) printf '%s\theld\texit 0\n' "$name" >>"$table" ;;
        124) printf '%s\tfailed\tstill running after %s s\n' "$name" "$seconds" >>"$table" ;;
        *) printf '%s\tfailed\texit %s, see %s\n' "$name" "$status" "$results/$name.txt" >>"$table" ;;
    esac
}

if [ -n "$no_gpu" ]; then  # the fit's checks on this CPU: do they read what a run leaves?
    echo "== fit_to_end, dry run on the CPU ($no_gpu)"
    timeout 300 python3 -m benchmarks.gpu_fit_to_end --accelerator cpu --model debug --sequence-length 64 \
        --table "$table" >"$results/fit_to_end.txt" 2>&1
    cat "$results/fit_to_end.txt"
fi
check fit_to_end 90 python3 -m benchmarks.gpu_fit_to_end --table "$table"
check tests 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py
check throughput 180 python3 -m benchmarks.gpu_throughput --steps 30
check overhead_debug 90 python3 -m benchmarks.lightning_overhead --accelerator gpu --model debug \
    --sequence-length 64 --global-batch-size 16 --micro-batch-size 16 --steps 100 --repeats 2
check overhead_small 90 python3 -m benchmarks.lightning_overhead --accelerator gpu --model small \
    --global-batch-size 16 --micro-batch-size 16 --steps 60 --repeats 2

echo "== what held"
awk -F'\t' '{printf "  %-44s %-8s %s\n", $1, $2, $3}' "$table" | tee "$results/table.txt"
