#!/usr/bin/env bash
# Download the wheels that tests/gpu/run.sh installs on a GPU machine without
# network: MPICH (mpicc, mpiexec, libmpi), mpi4py, pytest-mpi, and the build
# tools the machine may lack. Run it where PyPI is reachable; the folder
# (about 15 MiB) then travels to the GPU machine.
#
#   tests/gpu/prepare_wheels.sh WHEEL_DIR [PYTHON_VERSION]    (default 3.12)
#
# Versions are pinned to the ones jaxcomm is tested with; set GPU_WHEELS to a
# space-separated list of requirements to fetch others.
#
# With MPI4JAX_PYTHON set to a Python of the GPU machine's version, it also
# builds mpi4jax 0.9.1's wheel (PyPI has its source only) with its CUDA
# extension, for the GPU benchmark's side-by-side columns; nvcc must be in
# /usr/local/cuda or CUDA_ROOT. Its handlers are built against the FFI of the
# jax it is built with, and a jaxlib of an older FFI refuses them: set
# MPI4JAX_JAX to the GPU machine's jax (e.g. jax==0.11.2; default: the
# newest). With MPI_PREFIX set to an MPI's install prefix (such as the
# CUDA-aware one of tests/gpu/build_cuda_mpi.sh), mpi4jax is built against
# that MPI's mpicc and the mpi4py wheel for it already in WHEEL_DIR, instead
# of the mpich wheel. mpi4jax is never a dependency of jaxcomm.
set -euo pipefail

if [[ $# -lt 1 || $# -gt 2 || $1 == -h || $1 == --help ]]; then
  sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
wheel_dir=$1
python_version=${2:-3.12}
python=${PYTHON:-python3}
limit_mib=40

# mpi4py 4.x wheels load whichever libmpi they find at run time (here the
# mpich wheel's, in the same environment); scikit-build-core needs packaging
# and pathspec; pytest-mpi needs pytest and its own dependencies.
wheels=(mpich==5.0.2 mpi4py==4.1.2 pytest-mpi==0.6 pybind11==3.1.0
  scikit-build-core==1.1.2 packaging pathspec pytest pluggy iniconfig pygments)
# Another MPI brings its own mpi4py, built against it (build_cuda_mpi.sh).
if [[ -n ${MPI_PREFIX:-} ]]; then
  wheels=("${wheels[@]:2}")
fi
if [[ -n ${GPU_WHEELS:-} ]]; then
  read -r -a wheels <<<"$GPU_WHEELS"
fi

mkdir -p "$wheel_dir"
"$python" -m pip download --quiet --disable-pip-version-check \
  --only-binary=:all: --no-deps --implementation cp \
  --python-version "$python_version" \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  --dest "$wheel_dir" "${wheels[@]}"

if [[ -n ${MPI4JAX_PYTHON:-} ]]; then
  build_venv=$(mktemp -d)
  "$MPI4JAX_PYTHON" -m venv "$build_venv"
  mpi_path=$build_venv/bin
  if [[ -n ${MPI_PREFIX:-} ]]; then
    "$build_venv/bin/pip" install --quiet --disable-pip-version-check --no-index \
      --find-links "$wheel_dir" mpi4py
    mpi_path=$MPI_PREFIX/bin:$mpi_path
  else
    "$build_venv/bin/pip" install --quiet --disable-pip-version-check mpich==5.0.2 mpi4py==4.1.2
  fi
  "$build_venv/bin/pip" install --quiet --disable-pip-version-check \
    nanobind cython setuptools wheel "${MPI4JAX_JAX:-jax}"
  # Its build finds mpicc and the CUDA toolkit through the environment.
  PATH="$mpi_path:$PATH" CUDA_ROOT=${CUDA_ROOT:-/usr/local/cuda} \
    "$build_venv/bin/pip" wheel --quiet --disable-pip-version-check --no-build-isolation --no-cache-dir \
    --no-deps -w "$wheel_dir" mpi4jax==0.9.1
  rm -rf "$build_venv"
fi

(cd "$wheel_dir" && sha256sum -- *.whl >SHA256SUMS)
total_kib=$(du -sk "$wheel_dir" | cut -f1)
ls -l "$wheel_dir"
echo "total: $((total_kib / 1024)) MiB in $wheel_dir"
if ((total_kib > limit_mib * 1024)); then
  echo "error: the wheel folder is over $limit_mib MiB; it must stay small to travel" >&2
  exit 1
fi
