#!/usr/bin/env bash
# One command for a GPU slot (H100/H200), timing FIRST: the per-step time-outs add up to 9.75 minutes
# (75 + 30 + 180 + 90 + 130 + 20 + 60 s; the packed step JIT-compiles its kernels first), and each step's output is
# written as it goes.
#   0. the Gluon forward (kernels/gluon_forward.py, sm_90 / sm_100), checked against kernels/reference.py, then timed
#      against the current forward (benchmarks/gluon_check.py; no interpreter runs Gluon: the first check it gets)
#   0b. the two forward variants (current, warp-specialized: kernels/triton_forward_ws.py), checked, then timed
#   1. timing table: stable_attn's Triton kernels against SDPA flash / cuDNN (benchmarks/gpu_bench.py)
#   2. packed documents: attention_varlen against attention() on the same documents padded (gpu_bench.py)
#   3. the Triton kernel tests on CUDA (each variant is JIT-compiled for the real GPU there)
#   4. the tensor-core arithmetic model against tl.dot on this GPU
#   5. the rounding-bias study with real bf16 tensor-core products (docs/NUMERICS.md)
# Exit status 1 if a step failed or ran out of time (a time-out is reported by name).
#   bash benchmarks/gpu_check.sh [json-path]      (default: $OUT/gpu_bench.json, or ./gpu_bench.json)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the GPU machine runs the working tree, not an install
JSON="${1:-${OUT:-.}/gpu_bench.json}"
DIR="$(dirname "$JSON")"
status=0

step() {  # step NAME SECONDS COMMAND...: run with a time-out, say how it ended
    local name=$1 limit=$2 rc
    shift 2
    echo "== $name (at most ${limit}s) =="
    local t0=$SECONDS
    timeout "$limit" "$@"
    rc=$?
    if [ $rc -eq 124 ]; then echo "!! $name: timed out after ${limit}s"; fi
    if [ $rc -ne 0 ]; then status=1; fi
    echo "== $name: exit $rc after $((SECONDS - t0))s =="
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"

step "Gluon forward: checked against the reference, then timed against the current forward" 75 \
    python benchmarks/gluon_check.py --json "$DIR/gluon_check.json"

step "forward variants: current vs warp-specialized (checked, then timed)" 30 \
    python benchmarks/forward_variants.py --json "$DIR/forward_variants.json"

step "timing: stable_attn vs SDPA (interleaved rounds, kernels only)" 180 \
    python benchmarks/gpu_bench.py --no-varlen --json "$JSON"

step "timing: packed documents, varlen vs padded" 90 \
    python benchmarks/gpu_bench.py --varlen-only --json "$DIR/gpu_bench_varlen.json"

# the compile-only tests need no GPU (CI runs them); everything else in tests/kernels runs on CUDA
step "kernel tests on CUDA" 130 env STABLE_ATTN_TEST_DEVICE=cuda python -m pytest tests/kernels -q -m "not slow" \
    -x -p no:cacheprovider --durations=5 \
    --ignore=tests/kernels/test_triton_compile.py --ignore=tests/kernels/test_kernel_resources.py \
    --ignore=tests/kernels/test_gluon_forward.py

step "NaN queries stay NaN (forward, backward, decode, varlen)" 20 \
    env STABLE_ATTN_TEST_DEVICE=cuda python -m pytest tests/faults/test_nan_query_faults.py -q -p no:cacheprovider

step "tensor-core model against tl.dot (stable_attn.numerics.tensor_core)" 20 \
    env STABLE_ATTN_TEST_DEVICE=cuda python -m pytest tests/numerics/gpu_tensor_core_check.py -q -p no:cacheprovider

step "rounding-bias study on tensor cores" 60 \
    python benchmarks/bias_study.py --device cuda --json "$DIR/bias_study_cuda.json"
exit $status
