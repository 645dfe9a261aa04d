"""Shared fixtures and helpers for the jaxcomm test suite.

Run with ``mpiexec -n N python -m pytest --with-mpi`` (N = 1, 2, 3), or
plain ``python -m pytest`` for the tests that need no MPI launch.
"""

import contextlib
import os
import pathlib
import sys

# `python -m pytest` puts the source checkout first on sys.path, where the
# jaxcomm package has no compiled kernels: test the installed package instead.
_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if pathlib.Path(p or os.getcwd()).resolve() != _ROOT]

import jax  # noqa: E402

# Tests cover every dtype JAX has, 64-bit ones included.
jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from mpi4py import MPI  # noqa: E402

import jaxcomm  # noqa: E402
from jaxcomm import JaxComm  # noqa: E402

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

SHAPES = [(), (0,), (7,), (3, 4)]


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
        jax.monitoring.unregister_event_duration_listener(listener)
