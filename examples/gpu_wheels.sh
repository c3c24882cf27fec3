#!/usr/bin/env bash
# Fetch, on this machine (it reaches the package registry; a lent GPU machine reaches
# nothing), the Python 3.12 wheels the GPU machine lacks into .whl/, which git ignores and
# `examples/gpu_session.sh` installs there:
#   bash examples/gpu_wheels.sh               # msgspec, gguf, aiolimiter, pytest-asyncio, llguidance, rapidfuzz
#   bash examples/gpu_wheels.sh --flashinfer  # + flashinfer-python, slimmed to fit, and apache-tvm-ffi
# Then: device run, command "bash examples/gpu_session.sh", carry [".whl"].
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
mkdir -p .whl
get() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl "$@"
}
get msgspec==0.22.0 gguf==0.19.0 aiolimiter==1.3.0 pytest-asyncio==1.5.0 llguidance==1.9.1 rapidfuzz==3.14.6
if [ "${1:-}" = "--flashinfer" ]; then
  get apache-tvm-ffi==0.1.15.post2
  tmp=$(mktemp -d)
  get flashinfer-python==0.7.2.post1 -d "$tmp"
  # Keep every .py file and the attention kernels' sources; drop the CUDA sources of the rest.
  python3 examples/slim_wheel.py "$tmp"/flashinfer_python-*.whl .whl/"$(basename "$tmp"/flashinfer_python-*.whl)" \
    --drop-subfolders-of flashinfer/data/csrc/ --keep generated \
    --drop-subfolders-of flashinfer/experimental/ --drop-subfolders-of flashinfer/moe_ep/
  rm -rf "$tmp"
fi
du -ch .whl/*.whl | tail -1
