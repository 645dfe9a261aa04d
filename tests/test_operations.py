"""The operation table (``operations.py``): complete, and right about every row.

Completeness needs no MPI launch: every FFI target of ``jaxcomm/kernels/ops.def``
(and of the installed kernels) is used by a row or mapped to one, and every
public ``JaxComm`` member is called by a row or listed as moving no data. The
rows' claims (results, MPI calls, FFI targets) are checked on every rank.
"""

import pathlib
import re

import jax
import numpy as np
import pytest
from conftest import mpi_debug, rank_data, unchanged
from operations import (
    BY_ID,
    COUNTED,
    INTERNAL_TARGETS,
    NOT_COMMUNICATING,
    OPERATIONS,
    params,
    select,
)

import jaxcomm
from jaxcomm import JaxComm

OPS_DEF = pathlib.Path(__file__).resolve().parent.parent / "jaxcomm" / "kernels" / "ops.def"


def _ops_def_targets():
    """The targets of ``ops.def``'s rows (its python_name), from the repository."""
    text = re.sub(r"//.*", "", OPS_DEF.read_text())
    return set(re.findall(r"^JAXCOMM_OP\((\w+),", text, flags=re.MULTILINE))


def _installed_targets():
    """The targets the installed CPU kernels register, ``jaxcomm_`` left off."""
    return {name.removeprefix("jaxcomm_") for name in jaxcomm._runtime._kernels_cpu.attributes()}


def _table_targets():
    return {target for op in OPERATIONS for target in op.targets}


def test_every_ffi_target_is_in_the_table():
    for where, targets in (("ops.def", _ops_def_targets()), ("the kernels", _installed_targets())):
        missing = targets - _table_targets() - set(INTERNAL_TARGETS)
        assert not missing, (
            f"FFI targets of {where} in no row of tests/operations.py: {sorted(missing)}; "
            "add a row (or map an internal target in INTERNAL_TARGETS)"
        )
        stale = (_table_targets() | set(INTERNAL_TARGETS)) - targets
        assert not stale, f"tests/operations.py names targets {where} lacks: {sorted(stale)}"


def test_internal_targets_name_rows_that_exist():
    for target, internal in INTERNAL_TARGETS.items():
        assert internal.row in BY_ID, f"{target} is mapped to {internal.row!r}, which is no row"
        assert target not in BY_ID[internal.row].targets, f"{target} is its row's own target"


def test_every_public_method_is_in_the_table():
    public = {name for name in dir(JaxComm) if not name.startswith("_")}
    called = {method for op in OPERATIONS for method in op.methods}
    missing = public - called - set(NOT_COMMUNICATING)
    assert not missing, (
        f"public JaxComm members in no row of tests/operations.py: {sorted(missing)}; add a row "
        "(or list the member in NOT_COMMUNICATING if it moves no data)"
    )
    assert not called - public, f"rows call what JaxComm lacks: {sorted(called - public)}"
    assert not set(NOT_COMMUNICATING) - public, sorted(set(NOT_COMMUNICATING) - public)
    assert not called & set(NOT_COMMUNICATING), sorted(called & set(NOT_COMMUNICATING))


# The rows' claims --------------------------------------------------------------


@pytest.fixture(scope="module")
def grid(jc):
    """A periodic one-axis Cartesian JaxComm over the ranks, for the rows that need one."""
    comm = JaxComm.from_cart([jc.size], periods=[True])
    yield comm
    comm.free()


def _comm_for(op, jc, grid):
    return grid if op.grid else jc


def _data(op, size):
    return lambda r: rank_data(r, op.shape(size, r), np.dtype(np.float64))


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("op", params(select(grid=None)))
def test_result(jc, grid, op, mode):
    comm = _comm_for(op, jc, grid)
    data = _data(op, comm.size)
    x = jax.numpy.asarray(data(comm.rank))
    call = (lambda x: op.call(comm, x)) if mode == "eager" else jax.jit(lambda x: op.call(comm, x))
    got = call(x)
    want = op.expected(data, comm.rank, comm.size)
    assert np.shape(got) == want.shape
    np.testing.assert_array_equal(np.asarray(got), want)
    unchanged(x, data(comm.rank))


@pytest.mark.mpi
@pytest.mark.parametrize("op", params(select(grid=None)))
def test_mpi_calls(jc, grid, op, capfd):
    comm = _comm_for(op, jc, grid)
    x = jax.numpy.asarray(_data(op, comm.size)(comm.rank))
    capfd.readouterr()
    with mpi_debug():
        jax.block_until_ready(jax.jit(lambda x: op.call(comm, x))(x))
        jaxcomm.sync()
    lines = [line for line in capfd.readouterr().err.splitlines() if " | MPI_" in line]
    calls = tuple(line.split(" | ")[1].split()[0] for line in lines)
    assert calls == op.mpi
    # Each line names the rank that made the call, in the op's communicator.
    assert {line.split(" | ")[0] for line in lines} <= {f"r{comm.rank}"}


def _lowered_targets(fn, x):
    text = jax.jit(fn).lower(x).as_text()
    # jaxcomm_zero_after is no operation's: it makes the zeros off root of
    # gather's rows (tests/test_gather.py).
    return set(re.findall(r"custom_call @jaxcomm_(\w+)\(", text)) - {"zero_after"}


@pytest.mark.mpi
@pytest.mark.parametrize("op", params(select(grid=None)))
def test_targets(jc, grid, op):
    comm = _comm_for(op, jc, grid)
    x = jax.ShapeDtypeStruct(op.shape(comm.size, comm.rank), np.float64)
    assert _lowered_targets(lambda x: op.call(comm, x), x) == set(op.targets)


@pytest.mark.mpi
@pytest.mark.parametrize("target", sorted(INTERNAL_TARGETS))
def test_internal_target_is_used_as_the_table_says(jc, target):
    call = INTERNAL_TARGETS[target].call
    x = jax.ShapeDtypeStruct((2, 3), np.float64)
    assert target in _lowered_targets(lambda x: call(jc, x), x)


def _counts_as(value, given):
    if given == "list":
        return value
    array = np.asarray(value, np.int32)
    return array if given == "numpy" else jax.numpy.asarray(array)


@pytest.mark.mpi
@pytest.mark.parametrize("given", ["list", "numpy", "jax"])
@pytest.mark.parametrize("mode", ["eager", "closed", "argument"])
@pytest.mark.parametrize("row", [pytest.param(row, id=row.id) for row in COUNTED])
def test_counts_given_as(jc, grid, row, mode, given):
    """Counts as lists, NumPy or JAX arrays: eager, closed over by jit (constants) or jit arguments."""
    comm = grid if row.grid else jc
    data = lambda r: rank_data(r, row.shape(comm.size, r), np.dtype(np.float64))  # noqa: E731
    x = jax.numpy.asarray(data(comm.rank))
    counts = [_counts_as(c, given) for c in row.counts(comm.size, comm.rank)]
    if mode == "eager":
        got = row.call(comm, x, *counts)
    elif mode == "closed":
        got = jax.jit(lambda x: row.call(comm, x, *counts))(x)
    else:
        traced = jax.jit(lambda x, *counts: row.call(comm, x, *counts))
        if row.static:
            # Raised while tracing, alike on every rank, before any MPI call.
            with pytest.raises(TypeError, match="traced value"):
                traced(x, *counts)
            return
        got = traced(x, *counts)
    want = row.expected(data, comm.rank, comm.size)
    assert np.shape(got) == want.shape
    np.testing.assert_array_equal(np.asarray(got), want)
    unchanged(x, data(comm.rank))
