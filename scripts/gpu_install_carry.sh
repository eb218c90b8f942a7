#!/usr/bin/env bash
# Install the packages an offline GPU machine lacks from the wheel files of .carry/ (see
# ../shared/gpu/prepare-carry.sh), into /tmp/site. Two calls when the CuTe DSL runtime travels in two
# halves (at most 64 MiB per transfer, the project's tree included); the machine must stay warm between them:
#   bash scripts/gpu_install_carry.sh a   # carry .carry/cutedsl-a (+ .carry/wheels-a: apache-tvm-ffi): half a kept
#   bash scripts/gpu_install_carry.sh b   # carry .carry/cutedsl-b and .carry/wheels (the small CuTe DSL wheels)
# then: export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
# FlashQLA (the GDN experiment's flashqla control) goes to its own folder, /tmp/site-qla, because its
# TileLang pins apache-tvm-ffi below 0.1.13 and the cutedsl extra wants 0.1.15 or later; two calls too:
#   bash scripts/gpu_install_carry.sh qla-a   # carry .carry/flashqla-a (the TileLang wheel)
#   bash scripts/gpu_install_carry.sh qla-b   # carry .carry/flashqla-b (flash-qla, z3-solver, apache-tvm-ffi 0.1.12,
#     torch-c-dlpack-ext: scripts/prepare_carry.sh moves the last two out of a; add TileLang's ml-dtypes,
#     cloudpickle and psutil wheels there if the GPU machine lacks them: pip download --no-deps --only-binary=:all:
#     --python-version 3.12 --platform manylinux_2_28_x86_64 -d .carry/flashqla-b ml-dtypes cloudpickle psutil)
# then run the GDN experiment with PYTHONPATH=/tmp/site-qla (not beside /tmp/site, whose tvm-ffi is newer).
# FlashQLA's TileLang compiles its kernels on first use, for each shape (minutes per shape on a fresh
# machine: most of a ten-minute call; experiments/gdn/configs/h200-flashqla-cache.yaml compiles them all in one). Run with TILELANG_CACHE_DIR=/tmp/tilelang-cache and, at the end of
# that call, `tar czf $OUT/tilelang-cache.tgz -C /tmp tilelang-cache`; put that file in
# .carry/flashqla-b/ and qla-b unpacks it, so the next machine reuses the compiled kernels.
# pip --target does not merge a wheel into a package directory that exists already (the runtime wheel
# and the base wheel share nvidia_cutlass_dsl/), so the runtime goes to /tmp/site2 and is copied over.
# Any .carry/wheels*/ folder present in a call is installed too (e.g. .carry/wheels-anchors: FLA, Liger).
set -euo pipefail
install_present() {
  local whl=(.carry/wheels*/*.whl)
  [ -e "${whl[0]}" ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "${whl[@]}"
  return 0
}
case "${1:-}" in
  a)
    mkdir -p /root/carry && cp .carry/cutedsl-a/part.aa /root/carry/
    install_present ;;
  b)
    if [ ! -e /root/carry/part.aa ]; then  # a fresh machine: the call with half a did not run on this one
      echo "no /root/carry/part.aa on this machine: run 'a' again, then 'b' right after it" >&2
      exit 1
    fi
    wheel=$(cat .carry/cutedsl-b/WHEEL_NAME)
    cat /root/carry/part.aa .carry/cutedsl-b/part.ab > "/tmp/$wheel"
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 "/tmp/$wheel"
    install_present
    cp -r /tmp/site2/. /tmp/site/
    PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages python3 -c "import cutlass, tvm_ffi; print('CuTe DSL ready')" ;;
  qla-a)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-qla .carry/flashqla-a/*.whl ;;
  qla-b)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-qla .carry/flashqla-b/*.whl
    if [ -e .carry/flashqla-b/tilelang-cache.tgz ]; then
      tar xzf .carry/flashqla-b/tilelang-cache.tgz -C /tmp && echo "TileLang cache: /tmp/tilelang-cache (export TILELANG_CACHE_DIR)"
    fi
    PYTHONPATH=/tmp/site-qla python3 -c "import flash_qla; print('FlashQLA', flash_qla.__version__, 'ready')" ;;
  *) echo "usage: $0 a|b|qla-a|qla-b" >&2; exit 2 ;;
esac
