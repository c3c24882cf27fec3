#!/usr/bin/env bash
# Everything a lent GPU session checks, in one device call (a call costs a machine start, and a
# session has 15 minutes of device time): flashinfer's checks first (its kernels JIT-compile on
# first use, 17-37 s each), then the GPU tests, the kernel benchmark of both Qwen shapes with
# profiles, the end-to-end run and flashinfer's eager/paged timings. Each step gets what is left
# of DEADLINE seconds (default 550), so the logs always come back: packed as $OUT/gpu.tgz (the
# device returns at most 8 files). Wheels the device lacks travel in .whl (`bash
# examples/gpu_wheels.sh --flashinfer` fetches them here). Run it with
#   device run: command "bash examples/gpu_session.sh", carry [".whl"], timeout_s 580
# (2026-11-27, session 37: 464 s; 2026-12-06, session 89: 379 s before the departure probes).
# `bash examples/gpu_session.sh flashinfer` runs flashinfer's
# tests alone. flashinfer is installed in a folder of its own used by its steps only (installed,
# `auto` would pick it for the benchmarks' bf16 shapes).
set -o pipefail
FINAL=${OUT:-/tmp/gpu-session}; G=/tmp/gpu-session-logs; mkdir -p "$G" "$FINAL"; DEADLINE=${DEADLINE:-550}
left() { local l=$((DEADLINE - SECONDS)); [ $l -gt $1 ] && echo $1 || echo $((l > 1 ? l : 1)); }
trap 'tar czf "$FINAL/gpu.tgz" -C "$G" .' EXIT
base_wheels=$(ls .whl/*.whl | grep -v -e flashinfer -e tvm_ffi)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $base_wheels || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fisite \
  .whl/flashinfer_python-*.whl .whl/apache_tvm_ffi-*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OUT=$G
with_flashinfer() { FLASHINFER_CUDA_ARCH_LIST=9.0a PYTHONPATH=/tmp/fisite:$PYTHONPATH "$@"; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$G/device.txt"
echo "== flashinfer tests t=$SECONDS"
with_flashinfer timeout "$(left 220)" python3 -m pytest -rs --durations=8 tests/test_kernels.py tests/test_gpu.py -k flashinfer 2>&1 \
  | tee "$G/flashinfer-tests.log" | tail -15
[ "${1:-}" = "flashinfer" ] && exit
echo "== gpu tests t=$SECONDS"
# test_row_exact runs on the GPU machine's CPU (an AMX Xeon: its bf16 kernels differ from this one's)
timeout "$(left 130)" python3 -m pytest -rs tests/test_gpu.py tests/test_kernels.py tests/test_static.py tests/test_kv_arena.py \
  tests/test_row_exact.py tests/test_run_ahead.py 2>&1 | tee "$G/gpu-tests.log" | tail -8
echo "== kernels 1.5b t=$SECONDS"
timeout "$(left 110)" python3 -m specctl bench kernels --model 1.5b --dtype bf16 --repeats 20 --sizes 1,4,16 --profile 20 --decode 128 \
  --json "$G/kernels-1.5b.json" 2>&1 | tee "$G/kernels-1.5b.log" | tail -40
echo "== e2e t=$SECONDS"
timeout "$(left 110)" python3 examples/gpu_e2e_random_weights.py 128 2>&1 | tee "$G/e2e.log" | grep -e tok/s -e "draft step"
echo "== kernels 0.5b t=$SECONDS"
timeout "$(left 90)" python3 -m specctl bench kernels --model 0.5b --dtype bf16 --repeats 20 --sizes 1,4 --profile 20 \
  --json "$G/kernels-0.5b.json" 2>&1 | tee "$G/kernels-0.5b.log" | tail -30
echo "== flashinfer kernels t=$SECONDS"
with_flashinfer timeout "$(left 90)" python3 -m specctl bench kernels --model 1.5b --dtype bf16 --attention flashinfer \
  --no-graphs --sizes 1,4,16 --repeats 5 --sessions 4,16 --json "$G/kernels-1.5b-flashinfer.json" 2>&1 \
  | tee "$G/kernels-1.5b-flashinfer.log" | tail -20
echo "== bf16 departures t=$SECONDS"
# 2026-12-06: gpt-oss's bf16 chain departed from AR on CUDA (tests/test_gpu.py BF16_DEPARTS_ON_CUDA); and would
# one step shape for every forward (ONE_BUCKET) make a 1.5B's speculative rows AR's bits, at what AR cost?
timeout "$(left 40)" python3 examples/gpu_moe_departure.py gpt_oss 2>&1 | grep -v -i warn | tee "$G/moe-departure.log"
for rows in 64 16; do
  MIN_BUCKET=$rows VARIANTS=graphs+compile timeout "$(left 70)" python3 examples/gpu_bf16_departure.py 128 2>&1 \
    | grep -e prompt -e "==" -e padded | tee "$G/min-bucket-$rows-departure.log"
done
echo "== done t=$SECONDS"
