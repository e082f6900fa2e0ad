#!/usr/bin/env bash
# scripts/gpu_check.py on a GPU machine that has torch, transformers, jax (with its CUDA plugin), flax, optax,
# chex, tensorstore, matplotlib, seaborn, pyyaml and safetensors, no package index, and not the rest of tide's
# dependencies. Two steps, from the repository root:
#
#   bash scripts/gpu_check.sh --download     # here, with PyPI: the wheels below into .cache/gpu_check_wheels/
#                                            # (~6 MiB; .cache/ is git-ignored, so carry that folder along)
#   bash scripts/gpu_check.sh [ARGS...]      # there: installs those wheels into /tmp/gpu_check_site (no index,
#                                            # no dependencies), then python3 scripts/gpu_check.py --device cuda
#                                            # --out "${OUT:-bench_results}" ARGS (exit status: the check's)
#
# What travels: megatron-core (not on that machine), pydantic (trainer/config.py and trainer/jax/config.py are
# pydantic models), gymnax + gymnasium (the JAX engine's environments), flashbax (SAC's replay buffer) and crc32c
# (the checksum real publishes use), and typing-extensions (pydantic 2.14 needs >= 4.16; newer shadows older).
# Versions are those of this repository's .venv; Python 3.12 x86-64 builds.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS_DIR=.cache/gpu_check_wheels
WHEELS=(megatron-core==0.19.2 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
        typing-inspection==0.4.5 gymnax==1.0.1 gymnasium==1.3.0 farama-notifications==0.0.6 flashbax==0.1.3
        crc32c==2.9.post0 typing-extensions==4.16.0 peft==0.21.2 accelerate==1.16.0)
PY=${PYTHON:-python3}

if [[ "${1:-}" == "--download" ]]; then
  mkdir -p "$WHEELS_DIR"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$WHEELS_DIR" "${WHEELS[@]}"
  du -sh "$WHEELS_DIR"
  exit 0
fi

shopt -s nullglob
wheels=("$WHEELS_DIR"/*.whl)
if (( ${#wheels[@]} )); then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu_check_site \
    "${wheels[@]}"
  export PYTHONPATH="/tmp/gpu_check_site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "gpu_check.sh: no wheels in $WHEELS_DIR (--download them where PyPI is reachable); using what is installed" >&2
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
exec "$PY" scripts/gpu_check.py --device cuda --out "${OUT:-bench_results}" "$@"
