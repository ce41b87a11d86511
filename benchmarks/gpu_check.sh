#!/usr/bin/env bash
# The checks that need a GPU, as one script for a lent GPU (one H200, a few minutes):
#   1. the Triton kernels against torch eager (numerics and speed; benchmarks/gpu_kernels.py --quick --no-compile);
#   2. training steps of gpt-1.3b at tp = pp = dp = 1 against the planner's prediction for the h200 preset:
#      step time, MFU, peak memory, weight/gradient/optimizer bytes (benchmarks/gpu_step.py);
#   3. `hyparallel calibrate --quick --base h200` on the device, then step 2's planner's pick again, predicted with
#      the calibrated figures;
#   4. a torch.profiler step of the planner's pick and of full recomputation (the kernels that take the time);
#   5. the activation bytes small zoo and Hugging Face models save per micro-batch on CUDA against the planner's
#      (benchmarks/prediction.py --only activations --device cuda).
# Run from anywhere: bash benchmarks/gpu_check.sh [OUT_DIR] (default benchmarks/gpu-out). Logs and JSON go
# to OUT_DIR; benchmarks/run_all.py folds them into RESULTS.md. On a machine whose python3 lacks pydantic
# and cannot reach a package index, put wheels in .whl/ first (see the device notes in RESULTS.md).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-benchmarks/gpu-out}}"
out="$(mkdir -p "$out" && cd "$out" && pwd)"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
if ! python3 -c "import pydantic" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/hp-site .whl/*.whl
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/hp-site . >"$out/install.log" 2>&1 \
    || { echo "installing hyparallel failed; see $out/install.log"; exit 1; }
export PYTHONPATH=/tmp/hp-site${PYTHONPATH:+:$PYTHONPATH}
cd /tmp  # import the installed package (with its configs), not the source tree
repo="$OLDPWD"
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/device.txt"

echo "== 1. Triton kernels (gpu_kernels.py --quick --no-compile)"
timeout 150 python3 "$repo/benchmarks/gpu_kernels.py" --quick --no-compile 2>&1 | tee "$out/kernels.txt" || status=1

echo "== 2. gpt-1.3b steps against the h200 preset's prediction (gpu_step.py)"
timeout 150 python3 "$repo/benchmarks/gpu_step.py" --steps 8 --json "$out/step.json" 2>&1 | tee "$out/step.txt" || status=1

echo "== 3. calibrate on the device, then the planner's pick predicted with the calibrated figures"
if timeout 60 python3 -m hyparallel.cli calibrate --quick --base h200 --nproc 1 --out "$out/h200-calibrated.yaml" 2>&1 \
        | tee "$out/calibrate.txt"; then
    timeout 60 python3 "$repo/benchmarks/gpu_step.py" --steps 8 --cluster "$out/h200-calibrated.yaml" \
        --variants "planner's pick" --json "$out/step-calibrated.json" 2>&1 | tee "$out/step-calibrated.txt" || status=1
else
    status=1
fi

echo "== 4. profile one step: the planner's pick and full recomputation"
timeout 120 python3 "$repo/benchmarks/gpu_step.py" --steps 3 --variants "planner's pick,recompute full" --profile \
    2>&1 | tee "$out/profile.txt" || status=1

echo "== 5. activation bytes per micro-batch on CUDA against the planner's"
timeout 90 python3 "$repo/benchmarks/prediction.py" --only activations --device cuda 2>&1 | tee "$out/activations.txt" || status=1
exit $status
