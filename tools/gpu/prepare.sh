#!/usr/bin/env bash
# Ready this checkout for a device call, on the CPU machine:
#   .whl/   the wheels of tools/gpu/device-wheels.txt for the GPU machine's Python 3.12
#   .peer/  FlashMLA's dense decode sources and the peer build scripts (bench_decode.py --peer)
# Both folders are git-ignored; name them in the call's `carry`.
#
# usage: tools/gpu/prepare.sh [FLASHMLA_GIT_DIR]
#   FLASHMLA_GIT_DIR  a git directory of deepseek-ai/FlashMLA (the search tool's fetch puts one
#                     at /work/.mirror/deepseek-ai+FlashMLA/repo); without it .peer is skipped.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
here=tools/gpu

mkdir -p .whl
grep -v '^#' "$here/device-wheels.txt" | xargs python3 -m pip download -q --no-deps \
  --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl
echo "prepare: $(ls .whl | wc -l) wheels in .whl ($(du -sh .whl | cut -f1))"

if [ $# -ge 1 ]; then
  flashmla_git=$1
  rm -rf .peer/flashmla && mkdir -p .peer/flashmla
  # Only what the sm90 dense decode and its scheduler and combine need (~450 KB).
  git --git-dir="$flashmla_git" archive HEAD csrc/api csrc/params.h csrc/defines.h csrc/utils.h \
    csrc/kerutils csrc/sm90/decode/dense csrc/sm90/helpers.h csrc/smxx \
    | tar -x -C .peer/flashmla
  git --git-dir="$flashmla_git" rev-parse --short HEAD > .peer/flashmla/COMMIT
  cp ../shared/peers/flashmla/build.py .peer/
  echo "prepare: FlashMLA $(cat .peer/flashmla/COMMIT) in .peer ($(du -sh .peer | cut -f1))"
fi
