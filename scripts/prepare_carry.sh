#!/usr/bin/env bash
# Fill .carry/ (git-ignored) with the wheels the offline GPU machine lacks, in groups that fit the
# 64 MiB a call may carry together with the project's tree (see scripts/gpu_install_carry.sh):
#   .carry/cutedsl-a, .carry/cutedsl-b   the CuTe DSL runtime wheel in two halves (about 45 + 44 MiB)
#   .carry/wheels-a                      apache-tvm-ffi (the CuTe DSL call path), with half a
#   .carry/wheels                        the small CuTe DSL wheels, with half b
#   .carry/wheels-anchors                flash-linear-attention and Liger (the anchors), any later call
#   .carry/flashqla-a, .carry/flashqla-b FlashQLA and TileLang (FLASHQLA=0 skips them); TileLang's wheel
#                                        alone in a (about 50 MB), its apache-tvm-ffi and torch-c-dlpack-ext moved
#                                        to b, so that a call carrying a leaves room for the project's tree
# Usage: bash scripts/prepare_carry.sh [PATH/TO/shared/gpu/prepare-carry.sh]
set -euo pipefail
cd "$(dirname "$0")/.."
bash "${1:-../shared/gpu/prepare-carry.sh}"
mkdir -p .carry/wheels-a .carry/wheels-anchors
mv -f .carry/wheels/fla_core-*.whl .carry/wheels/liger_kernel-*.whl .carry/wheels-anchors/
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .carry/wheels-a "apache-tvm-ffi>=0.1.15"
shopt -s nullglob  # none left in a (moved already, or FLASHQLA=0): nothing to move
moved=(.carry/flashqla-a/apache_tvm_ffi-*.whl .carry/flashqla-a/torch_c_dlpack_ext-*.whl)
[ ${#moved[@]} -eq 0 ] || mv -f "${moved[@]}" .carry/flashqla-b/
du -sh .carry/*
