#!/usr/bin/env bash
# Sets up everything jax_brgemm needs on a fresh Debian/Ubuntu machine: the compiler, the
# Fashion-MNIST Debian package (the training data), and a virtual environment .venv with
# the package installed (non-editable) plus its test, train and bench extras.
# Idempotent: re-running only rebuilds the package.
set -euo pipefail
cd "$(dirname "$0")/.."

if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  missing=()
  command -v g++ >/dev/null || missing+=(g++)
  [ -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] || missing+=(dataset-fashion-mnist)
  python3 -c 'import venv, ensurepip' 2>/dev/null || missing+=(python3-venv)
  if [ ${#missing[@]} -gt 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
# Reinstall only when the sources changed since the last install (a second call is free).
stamp=$( (git rev-parse HEAD 2>/dev/null; git status --porcelain 2>/dev/null; git diff 2>/dev/null
          git ls-files -z --others --exclude-standard 2>/dev/null | xargs -0 -r sha256sum) | sha256sum | cut -c1-16)
if [ "$(cat .venv/.jax_brgemm-stamp 2>/dev/null)" != "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q ".[test,train,bench]"
  echo "$stamp" > .venv/.jax_brgemm-stamp
fi
echo "setup: jax_brgemm installed in .venv (kernel ISA: $(.venv/bin/python -c 'import jax_brgemm; print(jax_brgemm.isa())'))"
