#!/bin/sh
# A worker image's builder stage, after its install:
#   VARIANT=cpu sh /opt/build/worker.sh
# - VARIANT=cpu keeps one NIXL build: nixl's meta package requires both its CUDA 12 and CUDA 13
#   builds (~220 MB each) and loads, without CUDA, whichever is installed; gpu keeps both;
# - VARIANT=cpu also drops what a CPU worker never reads: NIXL's expert-parallel library (nixl_ep,
#   ~100 MB, which pdmesh does not use), and torch's C++ headers, test programs and tests (~190 MB:
#   for building extensions and testing torch; the shipped stage has no compiler and pdmesh runs
#   no torch.compile);
# - compiles the CPU layer kernel for every micro-architecture level into the installed package
#   (python -m pdmesh_kernels.cpu_layers --prebuild), so that the shipped stage, which has no
#   compiler, runs the fast path.
set -eu
case "${VARIANT:-cpu}" in
    cpu)
        /opt/venv/bin/pip uninstall -y nixl-cu13
        site=$(/opt/venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
        rm -rf "$site"/nixl_ep_cu12 "$site"/torch/include "$site"/torch/test "$site"/torch/bin/test_*
        ;;
    gpu) ;;
    *) echo "VARIANT must be cpu or gpu, not ${VARIANT}" >&2; exit 2 ;;
esac
/opt/venv/bin/python -m pdmesh_kernels.cpu_layers --prebuild
