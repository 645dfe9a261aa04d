#!/usr/bin/env bash
# A lean CI leg on an older jax: PYTHON JAX_VERSION VENV [TEST_FILE...].
#
# In a fresh virtual environment that pins jax, installs jaxcomm as a user
# does (pip install ".[mpich,test]", default build isolation): the build must
# compile against that jax's XLA FFI headers, or the first jitted call fails
# to register the kernels. Then, on 2 ranks, the test files given after VENV
# (by default ordering, point-to-point, collectives, autodiff, nonblocking
# ops, the checker and the compat module), the tests that start MPI jobs of
# their own (the compat module's settings, newer jax), and mpi4jax 0.9.1's
# own suite against the compat module. On jax 0.6 the derivatives of the
# nonblocking ops run again with JAX_USE_DIRECT_LINEARIZE=true: JAX's
# linearize rules as jax 0.7 and 0.8 call them (before is_vjp), which 0.6
# only uses behind that switch.
# JAXCOMM_CUDA=OFF: the CUDA module is built and tested on the newest jax.
set -euo pipefail
cd "$(dirname "$0")/.."
python=$1 jax_version=$2 venv=$3
shift 3
"$python" -m venv "$venv"
# shellcheck disable=SC1091
. "$venv/bin/activate"
pip install -q "jax==$jax_version"
JAXCOMM_CUDA=OFF pip install -q ".[mpich,test]"
(cd / && python -c 'import jax, jaxcomm; from jaxcomm import _build_info as b; print("jax", jax.__version__, "| kernels built against jaxlib", b.JAXLIB_VERSION, "FFI API", b.FFI_API)')
# Lean: the operation table (every operation, jit and eager) stands for the
# families' files, whose matrices of ops and dtypes exercise the kernels and
# argument checks, which do not depend on jax. The checker's call sites and
# the nonblocking ops' derivatives go through the JAX internals that changed
# most between versions.
files=("$@")
[ ${#files[@]} -gt 0 ] || files=(
  tests/test_ordering.py tests/test_dispatch.py tests/test_p2p.py tests/test_operations.py tests/test_autodiff.py
  tests/test_nonblocking.py tests/test_check.py tests/test_compat_mpi4jax.py tests/test_jax_versions.py)
timeout 1500 mpiexec -n 2 python -m pytest --with-mpi -q -p no:cacheprovider "${files[@]}" \
  -k "not test_check.py or mismatch or own_lines or matching_programs"
case $jax_version in 0.6.*)
  JAX_USE_DIRECT_LINEARIZE=true timeout 900 mpiexec -n 2 python -m pytest --with-mpi -q -p no:cacheprovider \
    tests/test_nonblocking.py tests/test_status.py ;;
esac
# The tests that start MPI jobs of their own (the compat module's settings, newer jax).
timeout 900 python -m pytest -q -p no:cacheprovider tests/test_compat_mpi4jax.py tests/test_jax_versions.py
# From / : the source tree's jaxcomm has no kernels.
(cd / && timeout 1500 python "$OLDPWD/tests/upstream/mpi4jax_suite.py" 2)
