#!/usr/bin/env bash
# The checks a CUDA machine runs, in one go (a lent GPU comes by the minute): what it has, the CUDA tests
# (the engines alone, then router + Ray + workers serving from the GPU; TP 2 over NCCL where there are two
# GPUs), what CUDA graphs give a worker's forwards (benchmarks/cuda_graphs.py, ~50 s), then the GPU benchmark
# (benchmarks/gpu.py). Logs and results go under OUT_DIR. Session 42 on an H200: tests 130 s, graphs ~35 s, the
# benchmark with --draft-device cpu --dtype bfloat16 --skip-demo 235 s. Packages the image lacks: gpu_wheels.sh.
#
#   bash tools/gpu_check.sh OUT_DIR [BENCH_ARGS...]
#   bash tools/gpu_check.sh /tmp/gpu --draft-device cpu --dtype bfloat16 --skip-demo     # session 42's run
#
# Environment: GRAPHS_ARGS (the graph study's, default "--dtype bfloat16 --heavy-layers 40"), and each step's
# limit in seconds, TESTS_S, GRAPHS_S and BENCH_S (300, 120, 400), to fit a lease.
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
graphs=${GRAPHS_ARGS:---dtype bfloat16 --heavy-layers 40}
timeout "${GRAPHS_S:-120}" "$py" -m benchmarks.cuda_graphs --device cuda $graphs 2>&1 | tee "$out/graphs.md"
echo "CUDA graphs: exit ${PIPESTATUS[0]} in $((SECONDS - started)) s"

started=$SECONDS
timeout "${BENCH_S:-400}" "$py" -m benchmarks.gpu --out "$out" "$@" 2>&1 | tee "$out/bench.log"
bench=${PIPESTATUS[0]}
echo "GPU benchmark: exit $bench in $((SECONDS - started)) s"
exit $((tests || bench))
