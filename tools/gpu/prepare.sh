#!/usr/bin/env bash
# Ready this checkout for a device call, on the CPU machine: the wheels of
# tools/gpu/device-wheels.txt for the GPU machine's Python 3.12 into .whl/ (git-ignored; name it
# in the call's `carry`).
#
# usage: tools/gpu/prepare.sh
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"

mkdir -p .whl
grep -v '^#' tools/gpu/device-wheels.txt | xargs python3 -m pip download -q --no-deps \
  --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl
echo "prepare: $(ls .whl | wc -l) wheels in .whl ($(du -sh .whl | cut -f1))"
