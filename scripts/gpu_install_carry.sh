#!/usr/bin/env bash
# Install the packages an offline GPU machine lacks from the wheel files of .carry/ (see
# ../shared/gpu/prepare-carry.sh), into /tmp/site. Two calls when the CuTe DSL runtime travels in two
# halves (at most 64 MiB per transfer); the machine must stay warm between them:
#   bash scripts/gpu_install_carry.sh a   # with .carry/cutedsl-a and .carry/wheels: the small wheels, half a
#   bash scripts/gpu_install_carry.sh b   # with .carry/cutedsl-b: joins the halves, installs the runtime
# then: export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
# pip --target does not merge a wheel into a package directory that exists already (the runtime wheel
# and the base wheel share nvidia_cutlass_dsl/), so the runtime goes to /tmp/site2 and is copied over.
set -euo pipefail
case "${1:-}" in
  a)
    mkdir -p /root/carry && cp .carry/cutedsl-a/part.aa /root/carry/
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/wheels/*.whl ;;
  b)
    wheel=$(cat .carry/cutedsl-b/WHEEL_NAME)
    cat /root/carry/part.aa .carry/cutedsl-b/part.ab > "/tmp/$wheel"
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 "/tmp/$wheel"
    cp -r /tmp/site2/. /tmp/site/
    PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages python3 -c "import cutlass, tvm_ffi; print('CuTe DSL ready')" ;;
  *) echo "usage: $0 a|b" >&2; exit 2 ;;
esac
