#!/usr/bin/env bash
# One command that sets up everything on a fresh machine (README "Set up"):
#   Debian rendering libraries (OSMesa for CPU machines, EGL for GPU machines),
#   a virtual environment in .venv, torch (the CPU wheel where there is no GPU),
#   the project with its dependencies, the LIBERO stack and assets, and the LIBERO
#   config written non-interactively.
# Idempotent: running it again only fills in what is missing.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-$ROOT/.venv}"

log() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }

install_system_packages() {
    local pkgs=(libosmesa6 libgl1 libegl1 libglx-mesa0)
    local missing=()
    for p in "${pkgs[@]}"; do
        dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
    done
    if [ ${#missing[@]} -eq 0 ]; then
        log "rendering libraries present"
        return
    fi
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    if ! command -v apt-get >/dev/null 2>&1; then
        log "WARNING: no apt-get; install ${missing[*]} yourself for rendering"
        return
    fi
    log "installing ${missing[*]}"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
}

has_cuda_gpu() {
    command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1
}

install_system_packages

if [ ! -x "$VENV/bin/python" ]; then
    log "creating virtual environment $VENV ($($PYTHON --version))"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip

if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    if has_cuda_gpu; then
        log "installing torch (CUDA build)"
        "${PIP[@]}" install -q "torch>=2.4"
    else
        log "installing torch 2.13.0 (CPU wheel)"
        "${PIP[@]}" install -q "torch==2.13.0"
    fi
fi

log "installing the project and its dependencies"
EXTRAS="dev"
if has_cuda_gpu; then EXTRAS="dev,gpu"; fi
"${PIP[@]}" install -q -e ".[$EXTRAS]"

# libero declares transformers/robomimic/wandb pins it does not need for simulation.
if ! "$VENV/bin/python" -m pip show libero >/dev/null 2>&1; then
    log "installing libero 0.1.1 (--no-deps)"
    "${PIP[@]}" install -q --no-deps "libero==0.1.1"
fi
# rlinf (pure Python) for the RLinf backend (rollout/rlinf): its declared dependencies pin a
# training stack we do not use; what its imports need comes with our own dependencies.
"${PIP[@]}" install -q --no-deps "rlinf==0.3.0"

log "linking LIBERO assets and writing the LIBERO config"
"$VENV/bin/python" -m envs.libero_setup

log "done. Activate with: source $VENV/bin/activate"
