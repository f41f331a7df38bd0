#!/usr/bin/env bash
# One command on a GPU machine (H100/H200, < 8 minutes): the Triton kernel tests on CUDA (each
# variant is JIT-compiled for the real GPU there), then the timing table of stable_attn against
# SDPA-flash (benchmarks/gpu_bench.py), then the bias study on tensor cores. Exit status 1 if a step failed.
#   bash benchmarks/gpu_check.sh [json-path]      (default: $OUT/gpu_bench.json, or ./gpu_bench.json)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the GPU machine runs the working tree, not an install
JSON="${1:-${OUT:-.}/gpu_bench.json}"
status=0

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"

echo "== kernel tests on CUDA =="
STABLE_ATTN_TEST_DEVICE=cuda timeout 240 python -m pytest tests/kernels/test_triton_attention.py \
    -q -m "not slow" -p no:cacheprovider --durations=5 || status=1

echo "== timing (median of triton.testing.do_bench) =="
timeout 300 python benchmarks/gpu_bench.py --json "$JSON" || status=1

echo "== rounding-bias study with real bf16 tensor-core products (docs/NUMERICS.md) =="
timeout 120 python benchmarks/bias_study.py --device cuda --json "$(dirname "$JSON")/bias_study_cuda.json" || status=1
exit $status
