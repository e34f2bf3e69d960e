#!/usr/bin/env bash
# Sets up everything graddbg needs on a fresh Debian machine with Python 3.11:
# Debian's graphviz (the `dot` program) when missing, and a virtual environment in
# .venv with graddbg installed (editable) and torch pinned through constraints.txt.
# Usage: scripts/setup.sh [--dev]      (--dev also installs the test tools and the docs tools)
set -euo pipefail
cd "$(dirname "$0")/.."
extra=""
[ "${1:-}" = "--dev" ] && extra="[dev,docs]"
# every stage says what it does (on stderr): the install is silent for minutes otherwise
say() { echo "setup: $*" >&2; }
torch_pin="$(sed -n 's/^torch==//p' constraints.txt)"
say "checking for Graphviz's dot${extra:+, g++} and a Python 3.11 virtual environment in .venv"

if ! command -v dot >/dev/null 2>&1; then
  echo "setup: 'dot' not found; installing Debian's graphviz" >&2
  if [ "$(id -u)" = "0" ]; then SUDO=""; else SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq </dev/null
  $SUDO apt-get install -y -qq graphviz </dev/null >/dev/null
fi

if [ -n "$extra" ] && ! command -v g++ >/dev/null 2>&1; then
  # the tests compile ddp_verify's fingerprint kernel (torch.compile needs a C++ compiler)
  echo "setup: 'g++' not found; installing Debian's g++" >&2
  if [ "$(id -u)" = "0" ]; then SUDO=""; else SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq </dev/null
  $SUDO apt-get install -y -qq g++ </dev/null >/dev/null
fi

PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  say "creating the virtual environment .venv ($PY)"
  if ! "$PY" -m venv .venv >/dev/null 2>&1; then
    # Debian's python3 ships venv separately
    echo "setup: installing Debian's python3-venv" >&2
    rm -rf .venv
    if [ "$(id -u)" = "0" ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq </dev/null
    $SUDO apt-get install -y -qq python3-venv </dev/null >/dev/null
    "$PY" -m venv .venv
  fi
fi
say "upgrading pip in .venv"
.venv/bin/python -m pip install -q --upgrade pip </dev/null >/dev/null 2>&1 || true
if [ -n "$extra" ]; then
  say "installing torch ${torch_pin} and graddbg with the test and docs tools into .venv (about 3 minutes)"
else
  say "installing torch ${torch_pin} and graddbg into .venv (about 2 minutes)"
fi
.venv/bin/python -m pip install -q -c constraints.txt -e ".${extra}" </dev/null
say "done: .venv/bin/graddbg is ready (try .venv/bin/graddbg demo)"
