#!/usr/bin/env bash
# The device check of a GPU machine, as one prepared command (see the device tool's README):
# the CUDA tests, then the GPU benchmark; logs and the markdown table under $OUT (or ./gpu_check_out).
#
#   bash bench/gpu_check.sh            # GB=8 by default; GB=2 for a quicker run
#
# The machine's python3 holds torch, transformers, safetensors, accelerate, pytest and hypothesis already;
# the repository is put on PYTHONPATH (nothing is installed).
set -o pipefail
out=${OUT:-gpu_check_out}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0))' 2>&1 | tee "$out/device.txt"
python3 -m pytest -x -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$out/cuda_tests.log"
tests=$?
python3 bench/gpu_bench.py --device cuda --gb "${GB:-8}" --markdown 2>&1 | tee "$out/gpu_bench.md"
bench=$?
echo "tests exit $tests, bench exit $bench"
exit $(( tests || bench ))
