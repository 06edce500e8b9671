#!/usr/bin/env bash
# One lease of an NVIDIA GPU machine, as one script (its time is short): the GPU-marked tests, then the MFU rows of
# bench/train_mfu_gpu.py (Llama-3.1-8B shapes, seq 4096: LoRA r16 and full fine-tuning, cuDNN attention, and LoRA
# once more on the blockwise path). Writes everything under $OUT (default /tmp/gpu_lease).
#
#   bash bench/gpu_lease.sh
#
# Packages the machine lacks (grain and its needs) come as wheels in .whl/ (see BENCHMARKS.md).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_lease}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda,cpu
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 LMZOO_TEST_XLA_OPT=default  # XLA's own settings on the GPU
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c "import jax, jaxlib; print('jax', jax.__version__, jax.devices())"; } 2>&1 | tee "$OUT/machine.txt"
timeout 120 python3 -m pytest -m gpu tests/test_kernels.py -q -p no:cacheprovider -o addopts="" -rA 2>&1 \
  | tail -40 | tee "$OUT/gpu_tests.txt"
run() {  # one benchmark row (at most $LIMIT s): its printed line and JSON appended to mfu.jsonl
  timeout "${LIMIT:-160}" python3 bench/train_mfu_gpu.py "$@" --steps 5 > "$OUT/row.txt" 2>&1
  echo "rc=$? $*" | tee -a "$OUT/mfu.txt"
  tail -2 "$OUT/row.txt" | tee -a "$OUT/mfu.txt"
  grep '^{' "$OUT/row.txt" >> "$OUT/mfu.jsonl" || tail -20 "$OUT/row.txt" >> "$OUT/errors.txt"
}
run --model 8b --lora 16 --params bfloat16 --batch 4 --remat save_dots
run --model 8b --params bfloat16 --batch 2 --remat save_dots
LIMIT=120 run --model 8b --lora 16 --params bfloat16 --batch 4 --remat save_dots --attention blockwise
rm -f "$OUT/row.txt"
