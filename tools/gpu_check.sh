#!/usr/bin/env bash
# The checks a CUDA machine runs, in one go (a lent GPU comes by the minute): what it has, the CUDA tests
# (the engines alone, then router + Ray + workers serving from the GPU; TP 2 over NCCL where there are two
# GPUs), the GPU benchmark (benchmarks/gpu.py), then what torch.compile would give a target's forwards
# (benchmarks/compile_step.py). Logs and results go under OUT_DIR. In session 32 the tests and the benchmark took
# ~6 minutes on an H100.
#
#   bash tools/gpu_check.sh OUT_DIR [BENCH_ARGS...]      # e.g. bash tools/gpu_check.sh /tmp/gpu --dtype bfloat16
#
# Environment: COMPILE_ARGS (the compile step's, default "--heavy-layers 8"), and each step's limit in seconds,
# TESTS_S, BENCH_S and COMPILE_S (300, 600, 240), to fit a lease.
set -uo pipefail
out=${1:?usage: tools/gpu_check.sh OUT_DIR [BENCH_ARGS...]}; shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
py=${PYTHON:-python3}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv 2>&1 | tee "$out/device.txt"
"$py" - <<'EOF' 2>&1 | tee -a "$out/device.txt"
import sys, torch, transformers, grpc, google.protobuf, ray
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else "-", "| GPUs", torch.cuda.device_count(),
      "| transformers", transformers.__version__, "| grpc", grpc.__version__,
      "| protobuf", google.protobuf.__version__, "| ray", ray.__version__)
EOF

started=$SECONDS
timeout "${TESTS_S:-300}" "$py" -m pytest -q -p no:cacheprovider tests/test_cuda_engines.py 2>&1 | tee "$out/tests.log"
tests=${PIPESTATUS[0]}
echo "CUDA tests: exit $tests in $((SECONDS - started)) s" | tee -a "$out/tests.log"

started=$SECONDS
timeout "${BENCH_S:-600}" "$py" -m benchmarks.gpu --out "$out" "$@" 2>&1 | tee "$out/bench.log"
bench=${PIPESTATUS[0]}
echo "GPU benchmark: exit $bench in $((SECONDS - started)) s"

started=$SECONDS
timeout "${COMPILE_S:-240}" "$py" -m benchmarks.compile_step --device cuda ${COMPILE_ARGS:---heavy-layers 8} 2>&1 |
  tee "$out/compile.log"
echo "compile step: exit ${PIPESTATUS[0]} in $((SECONDS - started)) s"
exit $((tests || bench))
