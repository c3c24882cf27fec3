#!/usr/bin/env bash
# Everything a lent GPU session checks, in one device call (a call costs a machine start):
# the GPU tests, the kernel benchmark of both Qwen shapes and the end-to-end run, logs and
# JSON under $OUT. Wheels the device lacks travel in .whl (`bash examples/gpu_wheels.sh
# [--flashinfer]` fetches them here); run it with
#   device run: command "bash examples/gpu_session.sh", carry [".whl"], timeout_s 540
# and, as a second call on the still-warm machine, the flashinfer checks alone (their kernels
# JIT-compile on first use, minutes):
#   device run: command "bash examples/gpu_session.sh flashinfer", carry [".whl"], timeout_s 420
# flashinfer goes to a folder of its own used by that step only (installed, `auto` would pick
# it for the benchmarks' bf16 shapes). A session with little device time: the flashinfer call
# first (its JIT needs 17-37 s a kernel; 2026-11-27's call of both took 396 s).
set -o pipefail
base_wheels=$(ls .whl/*.whl | grep -v -e flashinfer -e tvm_ffi)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $base_wheels \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/gpu-session}
mkdir -p "$OUT"
if [ "${1:-}" = "flashinfer" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fisite \
    .whl/flashinfer_python-*.whl .whl/apache_tvm_ffi-*.whl || exit 1
  FLASHINFER_CUDA_ARCH_LIST=9.0a PYTHONPATH=/tmp/fisite:$PYTHONPATH timeout 380 python3 -m pytest -rs --durations=5 \
    tests/test_kernels.py tests/test_gpu.py -k flashinfer 2>&1 | tee "$OUT/flashinfer-tests.log"
  # Eager forwards with flashinfer: one session, and batches as one paged call a layer over the KV arena.
  FLASHINFER_CUDA_ARCH_LIST=9.0a PYTHONPATH=/tmp/fisite:$PYTHONPATH timeout 200 python3 -m specctl bench kernels \
    --model 1.5b --dtype bf16 --attention flashinfer --no-graphs --sizes 1,4,16,64 --repeats 10 \
    --sessions 2,4,8,16,32 --json "$OUT/kernels-1.5b-flashinfer.json" 2>&1 | tee "$OUT/kernels-1.5b-flashinfer.log"
  exit
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/device.txt"
# test_row_exact runs on the GPU machine's CPU (an AMX Xeon: its bf16 kernels differ from this one's)
python3 -m pytest tests/test_gpu.py tests/test_kernels.py tests/test_static.py tests/test_kv_arena.py tests/test_row_exact.py 2>&1 \
  | tee "$OUT/gpu-tests.log" | tail -5
for model in 1.5b 0.5b; do
  python3 -m specctl bench kernels --model "$model" --dtype bf16 --repeats 30 --sessions 2,4,8 --profile 20 --json "$OUT/kernels-$model.json" 2>&1 \
    | tee "$OUT/kernels-$model.log"
done
python3 examples/gpu_e2e_random_weights.py 128 2>&1 | tee "$OUT/e2e.log"
