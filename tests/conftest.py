"""Shared fixtures and helpers for the jaxcomm test suite.

Run with ``mpiexec -n N python -m pytest --with-mpi`` (N = 1, 2, 3), or
plain ``python -m pytest`` for the tests that need no MPI launch.

``JAXCOMM_TEST_X64=0`` runs the suite in JAX's default configuration
(``jax_enable_x64`` off: float32 and int32 defaults, 64-bit inputs silently
narrowed). Tests marked ``x64`` (written for 64-bit values, such as float64
tolerances or logs naming float64) and test cases parametrized with a 64-bit
dtype are then skipped.
"""

import contextlib
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import time

# `python -m pytest` puts the source checkout first on sys.path, where the
# jaxcomm package has no compiled kernels: test the installed package instead.
_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if pathlib.Path(p or os.getcwd()).resolve() != _ROOT]

import jax  # noqa: E402


def _x64_from_environment():
    value = os.environ.get("JAXCOMM_TEST_X64", "1")
    if value not in ("0", "1"):
        raise ValueError(f"JAXCOMM_TEST_X64 must be 0 or 1, got {value!r}")
    return value == "1"


# By default tests cover every dtype JAX has, 64-bit ones included.
X64 = _x64_from_environment()
jax.config.update("jax_enable_x64", X64)

import jax.numpy as jnp  # noqa: E402
import mpi4py  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# The MPI thread level the suite runs at: jaxcomm supports mpi4py's default,
# 'multiple', and 'serialized' (the low-latency level on MPICH).
THREAD_LEVEL = os.environ.get("JAXCOMM_TEST_THREAD_LEVEL", "multiple")
if THREAD_LEVEL not in ("multiple", "serialized"):
    raise ValueError(
        f"JAXCOMM_TEST_THREAD_LEVEL must be multiple or serialized, got {THREAD_LEVEL!r}"
    )
mpi4py.rc.thread_level = THREAD_LEVEL

from mpi4py import MPI  # noqa: E402

import jaxcomm  # noqa: E402
from jaxcomm import JaxComm  # noqa: E402

# The checker and the watchdog, when a run turns them on (the same on every
# rank): the checker reports a deliberately bad message as a mismatch before
# MPI sees it, and both give eager calls a compiled program per call site.
MONITORED = any(
    os.environ.get(name, "") not in ("", "0") for name in ("JAXCOMM_CHECK", "JAXCOMM_TIMEOUT")
)
unmonitored = pytest.mark.skipif(
    MONITORED, reason="expects MPI's own errors or one program per eager call"
)


ALL_DTYPES = [
    np.dtype(bool),
    np.dtype("int8"),
    np.dtype("int16"),
    np.dtype("int32"),
    np.dtype("int64"),
    np.dtype("uint8"),
    np.dtype("uint16"),
    np.dtype("uint32"),
    np.dtype("uint64"),
    np.dtype("float16"),
    np.dtype(jnp.bfloat16),
    np.dtype("float32"),
    np.dtype("float64"),
    np.dtype("complex64"),
    np.dtype("complex128"),
]

# Without x64, JAX narrows these to their 32-bit kin.
_64_BIT = frozenset(["int64", "uint64", "float64", "complex128"])

SHAPES = [(), (0,), (7,), (3, 4)]


def pytest_report_header():
    return f"jaxcomm tests: jax_enable_x64={X64} (JAXCOMM_TEST_X64)"


def _is_64_bit_dtype(value):
    """Whether a test parameter names a 64-bit dtype (NumPy dtype, scalar type or name)."""
    if isinstance(value, tuple):
        return any(_is_64_bit_dtype(v) for v in value)
    if isinstance(value, type) and issubclass(value, np.generic):
        value = np.dtype(value)
    if isinstance(value, np.dtype):
        value = value.name
    return isinstance(value, str) and value in _64_BIT


def pytest_collection_modifyitems(items):
    # Decided at collection, the same on every rank: never a rank-dependent skip.
    if X64:
        return
    skip = pytest.mark.skip(reason="needs jax_enable_x64 (JAXCOMM_TEST_X64=0)")
    for item in items:
        params = getattr(item, "callspec", None)
        if item.get_closest_marker("x64") or (
            params and any(_is_64_bit_dtype(v) for v in params.params.values())
        ):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def jc():
    """One JaxComm over COMM_WORLD for the whole session (created on every rank)."""
    comm = JaxComm(MPI.COMM_WORLD)
    yield comm
    comm.free()


def rank_data(rank, shape, dtype, low=0, high=5):
    """Deterministic per-rank test data: small integers, exact in every dtype."""
    n = int(np.prod(shape, dtype=np.int64))
    values = (np.arange(n) * 3 + rank * 7) % (high - low) + low
    if dtype == np.dtype(bool):
        return ((np.arange(n) + rank) % 3 == 0).reshape(shape)
    data = values.astype(np.float64)
    if np.issubdtype(dtype, np.complexfloating):
        data = data + 1j * ((np.arange(n) + rank) % 3)
    return data.astype(dtype).reshape(shape)


def unchanged(x, original):
    """Assert that an input array still holds its original values."""
    np.testing.assert_array_equal(np.asarray(x), original)


# Variables an MPI launcher sets in its ranks. A test that starts MPI
# processes of its own runs only outside a launch (the plain pytest run), and
# hands them an environment without these, so they do not join the job.
LAUNCHER_VARS = ("PMI_", "HYDRA_", "MPIR_", "OMPI_", "PMIX_", "PRTE_", "MPI_LOCAL")
# Settings a user exports for every launch (Open MPI's consent to run as root,
# MCA parameters): they do not mean this process is a rank, and the processes
# a test starts need them too.
USER_SETTINGS = ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_MCA_", "PRTE_MCA_", "PMIX_MCA_")


def set_by_launcher(name):
    """Whether environment variable ``name`` is one an MPI launcher sets in its ranks."""
    return name.startswith(LAUNCHER_VARS) and not name.startswith(USER_SETTINGS)


spawns_own_mpi = pytest.mark.skipif(
    any(set_by_launcher(k) for k in os.environ),
    reason="spawns its own MPI processes; runs in the plain pytest run",
)


# A jitted function that ran once before raises its runtime errors as
# ValueError (JAX's C++ dispatch path types them so: jax issue #34083), and
# as jax.errors.JaxRuntimeError otherwise.
RUNTIME_ERRORS = (jax.errors.JaxRuntimeError, ValueError)


def not_reported_again():
    """Check that a kernel failure JAX raised to the caller is not raised again by ``sync()``."""
    jaxcomm.sync()


@pytest.fixture(autouse=True)
def no_unreported_failure():
    """Fail a test that leaves a kernel failure unreported, instead of the next one."""
    yield
    message = jaxcomm._runtime._kernels_cpu.take_error()
    assert message is None, f"a jaxcomm kernel failed and nothing reported it: {message}"


def mpiexec(n):
    """The command line that starts ``n`` ranks with this environment's launcher."""
    launcher = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which(
        "mpiexec"
    )
    if launcher is None:
        pytest.skip("no mpiexec")
    version = subprocess.run([launcher, "--version"], capture_output=True, text=True).stdout
    extra = ["--oversubscribe"] if "Open MPI" in version or "open-mpi" in version else []
    return [launcher, *extra, "-n", str(n)]


def run_job(tmp_path, script, *args, ranks=2, limit=120, **env):
    """Run ``script`` with ``args`` on ``ranks`` ranks under a time limit; the result and its seconds.

    ``env`` adds environment variables.
    """
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(script))
    start = time.monotonic()
    done = subprocess.run(
        ["timeout", "-k", "10", str(limit), *mpiexec(ranks), sys.executable, str(path), *args],
        capture_output=True,
        text=True,
        env=environment_without_launcher(**env),
        cwd=tmp_path,
    )
    return done, time.monotonic() - start


def environment_without_launcher(**extra):
    """This process's environment minus the launcher's variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not set_by_launcher(k)}
    env.update(extra)
    return env


@contextlib.contextmanager
def mpi_debug():
    """Log every MPI call made by the kernels (to stderr) inside the block."""
    jaxcomm.set_debug(True)
    try:
        yield
    finally:
        jaxcomm.set_debug(False)


@contextlib.contextmanager
def backend_compiles():
    """Collect, into the yielded list, the XLA compilations made inside the block."""
    compiles = []

    def listener(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield compiles
    finally:
        _unregister_duration_listener(listener)


def _unregister_duration_listener(listener):
    unregister = getattr(jax.monitoring, "unregister_event_duration_listener", None)
    if unregister is None:  # jax before 0.7 has only the private name
        from jax._src import monitoring

        unregister = monitoring._unregister_event_duration_listener_by_callback
    unregister(listener)
