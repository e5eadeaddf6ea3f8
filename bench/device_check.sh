#!/usr/bin/env bash
# The GPU checks of issue 42 as one prepared script for a lent CUDA machine (device tool).
#
#   bash bench/device_check.sh wheels   # here, once: the Python packages the GPU image lacks -> .whl/
#   bash bench/device_check.sh run      # there (carry .whl): CUDA tests + GPU benchmarks -> $OUT
#
# The GPU image has Python 3.12 with a CUDA torch, Triton, grpcio, protobuf, numpy,
# safetensors, tokenizers and transformers; what computed and blockd need beyond them
# travels as wheels. `run` writes everything under $OUT (default run/device): the
# pytest log, `python -m bench --only gpu`'s report, and two decode-step profiles (eager
# and with CUDA graphs) from `python -m bench.gpu_step`. Keep it under ~8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-run}
OUT=${OUT:-run/device}

if [ "$mode" = wheels ]; then
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
  platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
  for spec in "grpcio==1.85.1" "grpcio-health-checking==1.85.1" "grpcio-reflection==1.85.1" "protobuf" "structlog" \
    "pytest-asyncio" "valkey" "xxhash"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      "${platforms[@]}" -d .whl "$spec" || echo "no wheel for $spec"
  done
  ls -la .whl
  exit 0
fi

mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || { echo "wheel install failed"; exit 1; }
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"

# 1. CUDA tests (marked gpu) and the attention/graph tests on CUDA.
timeout 180 python3 -m pytest -q -m gpu -p no:cacheprovider tests/computed 2>&1 | tee "$OUT/pytest_gpu.log" | tail -5

# 2. One decode step under torch.profiler, eager then with CUDA graphs (the before/after).
for graphs in no-graphs graphs; do
  timeout 120 python3 -m bench.gpu_step --device cuda --rows 256 --context 1024 --$graphs \
    --json "$OUT/step_$graphs.json" 2>&1 | tee "$OUT/step_$graphs.txt" | tail -14
done

# 3. The GPU section: nano-vllm's workload, the shared-prefix workload, a step profile.
timeout 300 python3 -m bench --only gpu --out "$OUT/bench" 2>&1 | tee "$OUT/bench_gpu.log" | tail -20
echo "results under $OUT"
