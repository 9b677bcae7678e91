#!/usr/bin/env bash
# The Python packages a lent GPU machine's image may lack, as files to carry there (session 42's H200 image had no
# Ray, llguidance, FastAPI, gRPC health/reflection, and gRPC 1.84 where the stubs need 1.85.1). Ray's wheel (79 MB)
# is slimmed to ~40 MB (no Java, RLlib, Data, Serve, Tune, Train, LLM or dashboard front end), as a zip.
#
#   bash tools/gpu_wheels.sh .whl             # here: write the files (versions as this venv has them)
#   bash tools/gpu_wheels.sh .whl --install   # there, first: unpack what python3 lacks into /tmp/site
#   export PYTHONPATH="$PWD:/tmp/site"        # there, then: bash tools/gpu_check.sh OUT ...
set -euo pipefail
dir=${1:?usage: tools/gpu_wheels.sh DIR [--install]}
if [ "${2:-}" = --install ]; then                 # python3 -m zipfile: the image has no unzip
  mkdir -p /tmp/site
  for w in "$dir"/*.whl; do
    name=$(basename "$w" | cut -d- -f1 | tr _ -)
    case $name in grpcio|protobuf) ;; *) python3 -m pip show -q "$name" >/dev/null 2>&1 && continue;; esac
    echo "unpacking $name"; python3 -m zipfile -e "$w" /tmp/site
  done
  if ! python3 -c "import ray" 2>/dev/null; then
    echo "unpacking ray (slim)"; python3 -m zipfile -e "$dir"/ray-*-slim.zip /tmp/site
    chmod +x /tmp/site/ray/core/src/ray/gcs/gcs_server /tmp/site/ray/core/src/ray/raylet/raylet
  fi
  exit 0
fi
py=${PYTHON:-$PWD/.venv/bin/python}
version() { "$py" -m pip show "$1" | awk '/^Version/{print $2}'; }
get() { "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_31_x86_64 -d "$1" "${@:2}"; }
mkdir -p "$dir"
get "$dir" $(for p in grpcio protobuf grpcio-health-checking grpcio-reflection llguidance jsonschema \
  jsonschema-specifications referencing rpds-py fastapi starlette pydantic pydantic-core annotated-types \
  typing-inspection uvicorn googleapis-common-protos sniffio; do echo "$p==$(version $p)"; done)
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
get "$tmp" "ray==$(version ray)"
"$py" -m zipfile -e "$tmp"/ray-*.whl "$tmp/x"
(cd "$tmp/x" && rm -rf ray/jars ray/rllib ray/data ray/serve ray/tune ray/train ray/llm ray/dashboard/client &&
 zip -q -9 -r "$tmp/ray-slim.zip" .)
mv "$tmp/ray-slim.zip" "$dir/ray-$(version ray)-slim.zip"
du -sh "$dir"
