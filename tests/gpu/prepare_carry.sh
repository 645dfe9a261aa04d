#!/usr/bin/env bash
# Put together everything a GPU machine without MPI and network needs for
# tests/gpu/run.sh on the direct path: the CUDA-aware Open MPI of
# tests/gpu/build_cuda_mpi.sh (built first, or taken from its cache), mpi4py
# and mpi4jax 0.9.1 built against it for the GPU machine's Python, and the
# small wheels the build and the tests need. Run it where the network is.
#
#   tests/gpu/prepare_carry.sh CARRY_DIR [PREFIX]
#
# CARRY_DIR receives mpi/ (a copy of PREFIX, with .jaxcomm-prefix naming
# PREFIX, where run.sh links it back) and wheels/. Inside a git checkout it
# is added to .git/info/exclude, so that it travels only when named in the
# device tool's carry. PREFIX defaults to /opt/jaxcomm-ompi-cuda.
#
# Environment: WORK_DIR (build_cuda_mpi.sh's, /tmp/jaxcomm-cuda-mpi-build),
# GPU_PYTHON (a Python of the GPU machine's version; default the pyenv 3.12
# under /root/.pyenv), GPU_JAX (the GPU machine's jax, jax==0.11.2: mpi4jax's
# handlers must match its FFI), NO_MPI4JAX (1: leave mpi4jax out), LIMIT_MIB
# (58: what may travel beside a source tree of about 4 MiB under the device
# tool's 64 MiB).
set -euo pipefail

if [[ $# -lt 1 || $# -gt 2 || $1 == -h || $1 == --help ]]; then
  sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
here=$(realpath "$(dirname "$0")")
mkdir -p "$1"
carry=$(realpath "$1")
prefix=${2:-/opt/jaxcomm-ompi-cuda}
work=${WORK_DIR:-/tmp/jaxcomm-cuda-mpi-build}
gpu_python=${GPU_PYTHON:-$(compgen -G '/root/.pyenv/versions/3.12*/bin/python3' | tail -n 1)}
limit_mib=${LIMIT_MIB:-58}

# The MPI and mpi4py wheels for the GPU machine's Python (build_cuda_mpi.sh
# does nothing where its cache holds them).
MPI4PY_PYTHONS="$gpu_python ${MPI4PY_PYTHONS:-}" WHEEL_DIR=$work/wheels \
  "$here/build_cuda_mpi.sh" "$prefix" "$work"

rm -rf "$carry/mpi" "$carry/wheels"
mkdir -p "$carry/wheels"
cp -a "$prefix" "$carry/mpi"
echo "$prefix" >"$carry/mpi/.jaxcomm-prefix"
tag=$("$gpu_python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
cp "$work"/wheels/mpi4py-*-"$tag"-*.whl "$carry/wheels/"

version=$("$gpu_python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
if [[ ${NO_MPI4JAX:-0} == 1 ]]; then
  MPI_PREFIX=$prefix "$here/prepare_wheels.sh" "$carry/wheels" "$version"
else
  MPI_PREFIX=$prefix MPI4JAX_PYTHON=$gpu_python MPI4JAX_JAX=${GPU_JAX:-jax==0.11.2} \
    "$here/prepare_wheels.sh" "$carry/wheels" "$version"
fi

if top=$(git -C "$carry" rev-parse --show-toplevel 2>/dev/null) && [[ $carry == "$top"/* ]]; then
  exclude=$(git -C "$top" rev-parse --git-common-dir)/info/exclude
  [[ $exclude == /* ]] || exclude=$top/$exclude
  entry="/${carry#"$top"/}/"
  if ! grep -qxF "$entry" "$exclude" 2>/dev/null; then
    mkdir -p "$(dirname "$exclude")" && echo "$entry" >>"$exclude"
    echo "added $entry to $exclude"
  fi
fi

mpi_kib=$(du -sk "$carry/mpi" | cut -f1)
wheels_kib=$(du -sk "$carry/wheels" | cut -f1)
total_kib=$((mpi_kib + wheels_kib))
echo "carry: mpi/ $((mpi_kib / 1024)) MiB, wheels/ $((wheels_kib / 1024)) MiB," \
  "total $((total_kib / 1024)) MiB in $carry"
if ((total_kib > limit_mib * 1024)); then
  echo "error: over $limit_mib MiB; it must travel with the source tree under 64 MiB" >&2
  exit 1
fi
