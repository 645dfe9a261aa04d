"""Every op on the values users write, in the dtypes JAX gives them.

Inputs are Python scalars and lists, NumPy float64 and int64 arrays, NumPy
templates and counts: JAX turns them into its default dtypes, which are
float32 and int32 unless ``jax_enable_x64`` is on (CI runs the suite both
ways, see ``JAXCOMM_TEST_X64`` in conftest.py). Each result must come back in
that default dtype with the right values, eagerly and under ``jit``, and the
kernels must move it as that MPI type.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import X64, mpi_debug, rank_data
from mpi4py import MPI
from operations import BY_ID, params, select

from jaxcomm import JaxComm

# What jnp.asarray makes of a Python float / NumPy float64, and of an int / int64.
FLOAT = np.dtype(jnp.asarray(np.float64(0)).dtype)
INT = np.dtype(jnp.asarray(np.int64(0)).dtype)


def _floats(rank, n=4):
    return np.arange(n, dtype=np.float64) + 10.0 * rank


def _ints(rank, n=4):
    return np.arange(n, dtype=np.int64) * 3 + rank


def _chain(jc):
    source = jc.rank - 1 if jc.rank > 0 else MPI.PROC_NULL
    dest = jc.rank + 1 if jc.rank + 1 < jc.size else MPI.PROC_NULL
    return source, dest


def _v_counts(size):
    return [r % 3 + 1 for r in range(size)]


def _default_ints(counts):
    """Counts as JAX computes them (int32 unless x64), made static for ``jit``."""
    return np.asarray(jnp.asarray(counts))


def _allreduce(jc):
    rank, size = jc.rank, jc.size
    total = sum(_floats(r) for r in range(size))
    return [
        (lambda x: jc.allreduce(x), (_floats(rank),), total),
        (lambda x: jc.allreduce(x, op=MPI.MAX), (_ints(rank),), _ints(size - 1)),
        (lambda x: jc.allreduce(x), (rank + 0.5,), np.float64(sum(range(size)) + size / 2)),
        (lambda x: jc.allreduce(x), (rank,), np.int64(sum(range(size)))),
    ]


def _reduce(jc):
    rank, size = jc.rank, jc.size
    cases = []
    for root in range(size):
        want = sum(_ints(r) for r in range(size)) if rank == root else np.zeros(4, np.int64)
        cases.append((lambda x, root=root: jc.reduce(x, root=root), (_ints(rank),), want))
    return cases


def _scan(jc):
    rank = jc.rank
    return [
        (lambda x: jc.scan(x), (_floats(rank),), sum(_floats(r) for r in range(rank + 1))),
        (lambda x: jc.scan(x), (rank + 1,), np.int64(sum(range(1, rank + 2)))),
    ]


def _exscan(jc):
    rank = jc.rank
    below = sum(_floats(r) for r in range(rank)) + np.zeros(4)  # zeros on rank 0
    return [
        (lambda x: jc.exscan(x), (_floats(rank),), below),
        (lambda x: jc.exscan(x), (1.0,), np.float64(rank)),
    ]


def _reduce_scatter(jc):
    rank, size = jc.rank, jc.size
    x = np.arange(2 * size, dtype=np.float64) + rank
    total = sum(np.arange(2 * size, dtype=np.float64) + r for r in range(size))
    return [(lambda x: jc.reduce_scatter(x, tiled=True), (x,), total[2 * rank : 2 * rank + 2])]


def _bcast(jc):
    rank, size = jc.rank, jc.size
    return [
        (lambda x, root=root: jc.bcast(x, root=root), (_floats(rank),), _floats(root))
        for root in range(size)
    ] + [(lambda x: jc.bcast(x, root=size - 1), (rank * 2,), np.int64((size - 1) * 2))]


def _send_recv(jc):
    source, dest = _chain(jc)
    want = _floats(source) if source != MPI.PROC_NULL else np.zeros(4)

    def with_array_template(x):
        jc.send(x, dest)
        return jc.recv(np.zeros(4), source)

    def with_struct_template(x):
        jc.send(x, dest)
        return jc.recv(jax.ShapeDtypeStruct((4,), np.float64), source)

    return [
        (with_array_template, (_floats(jc.rank),), want),
        (with_struct_template, (_floats(jc.rank),), want),
    ]


def _sendrecv(jc):
    rank, size = jc.rank, jc.size
    left, right = (rank - 1) % size, (rank + 1) % size

    def ring(x):
        return jc.sendrecv(x, np.zeros(4), source=left, dest=right)

    def ring_ints(x):
        return jc.sendrecv(x, x, source=left, dest=right)

    return [(ring, (_floats(rank),), _floats(left)), (ring_ints, (_ints(rank),), _ints(left))]


def _allgather(jc):
    rank, size = jc.rank, jc.size
    stacked = np.stack([_ints(r) for r in range(size)])
    return [
        (lambda x: jc.allgather(x), (_ints(rank),), stacked),
        (lambda x: jc.allgather(x), (float(rank),), np.arange(size, dtype=np.float64)),
    ]


def _gather(jc):
    rank, size = jc.rank, jc.size
    cases = []
    for root in range(size):
        gathered = np.concatenate([_floats(r) for r in range(size)])
        want = gathered if rank == root else np.zeros(4 * size)
        cases.append(
            (lambda x, root=root: jc.gather(x, root=root, tiled=True), (_floats(rank),), want)
        )
    return cases


def _scatter(jc):
    rank, size = jc.rank, jc.size
    x = np.arange(2 * size, dtype=np.int64) + 100 * rank
    return [
        (
            lambda x, root=root: jc.scatter(x, root=root, tiled=True),
            (x,),
            (np.arange(2 * size) + 100 * root)[2 * rank : 2 * rank + 2],
        )
        for root in range(size)
    ]


def _alltoall(jc):
    rank, size = jc.rank, jc.size
    x = np.arange(size, dtype=np.float64) + 10.0 * rank
    return [(lambda x: jc.alltoall(x, tiled=True), (x,), np.arange(size) * 10.0 + rank)]


def _allgatherv(jc):
    rank, size = jc.rank, jc.size
    counts = _v_counts(size)
    x = _floats(rank, counts[rank])
    want = np.concatenate([_floats(r, counts[r]) for r in range(size)])
    as_int64, as_default = np.array(counts, np.int64), _default_ints(counts)
    return [
        (lambda x: jc.allgatherv(x, as_int64), (x,), want),
        (lambda x: jc.allgatherv(x, as_default), (x,), want),
    ]


def _gatherv(jc):
    rank, size = jc.rank, jc.size
    counts = _v_counts(size)
    as_default = _default_ints(counts)
    x = _ints(rank, counts[rank])
    gathered = np.concatenate([_ints(r, counts[r]) for r in range(size)])
    return [
        (
            lambda x, root=root: jc.gatherv(x, as_default, root=root),
            (x,),
            gathered if rank == root else np.zeros(sum(counts), np.int64),
        )
        for root in range(size)
    ]


def _scatterv(jc):
    rank, size = jc.rank, jc.size
    counts = _v_counts(size)
    offsets = np.cumsum([0] + counts)
    x = _floats(rank, sum(counts))
    return [
        (
            lambda x, root=root: jc.scatterv(x, np.array(counts, np.int64), root=root),
            (x,),
            _floats(root, sum(counts))[offsets[rank] : offsets[rank + 1]],
        )
        for root in range(size)
    ]


def _alltoallv(jc):
    rank, size = jc.rank, jc.size
    # Rank i sends i + 1 rows to every rank: counts[i][j] = i + 1.
    matrix = _default_ints([[i + 1] * size for i in range(size)])
    x = np.repeat(np.arange(size, dtype=np.float64) + 10.0 * rank, rank + 1)
    want = np.concatenate([np.full(i + 1, 10.0 * i + rank) for i in range(size)])
    return [(lambda x: jc.alltoallv(x, matrix), (x,), want)]


CASES = {
    "allreduce": _allreduce,
    "reduce": _reduce,
    "scan": _scan,
    "exscan": _exscan,
    "reduce_scatter": _reduce_scatter,
    "bcast": _bcast,
    "send/recv": _send_recv,
    "sendrecv": _sendrecv,
    "allgather": _allgather,
    "gather": _gather,
    "scatter": _scatter,
    "alltoall": _alltoall,
    "allgatherv": _allgatherv,
    "gatherv": _gatherv,
    "scatterv": _scatterv,
    "alltoallv": _alltoallv,
}


def _default_dtype(want):
    return FLOAT if np.issubdtype(np.asarray(want).dtype, np.floating) else INT


def test_defaults_follow_jaxcomm_test_x64():
    # Fails if the run meant to test JAX's default configuration does not.
    x64 = os.environ.get("JAXCOMM_TEST_X64", "1") == "1"
    assert jax.config.jax_enable_x64 == X64 == x64
    wide, narrow = ("float64", "int64"), ("float32", "int32")
    assert (FLOAT.name, INT.name) == (wide if x64 else narrow)


def _table_case(jc, op):
    """The row's own call on data of JAX's default float type."""
    data = lambda r: rank_data(r, op.shape(jc.size, r), FLOAT)  # noqa: E731
    return (lambda x: op.call(jc, x), (data(jc.rank),), op.expected(data, jc.rank, jc.size))


def test_cases_are_rows_of_the_table():
    assert set(CASES) <= set(BY_ID), sorted(set(CASES) - set(BY_ID))


@pytest.mark.mpi
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("op", params(select()))
def test_op_on_default_dtypes(jc, op, jit):
    cases = [_table_case(jc, op), *CASES.get(op.id, lambda jc: [])(jc)]
    for i, (fn, args, want) in enumerate(cases):
        got = (jax.jit(fn) if jit else fn)(*args)
        dtype = _default_dtype(want)
        assert got.dtype == dtype, f"case {i}: {got.dtype} != {dtype}"
        assert got.shape == np.shape(want), f"case {i}"
        want = np.asarray(want).astype(dtype)
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"case {i}")


@pytest.mark.mpi
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_shift_and_barrier_on_default_dtypes(jit):
    grid = JaxComm.from_cart([0], periods=[True])
    left = (grid.rank - 1) % grid.size
    shift = jax.jit(lambda x: grid.shift(x, 0)) if jit else (lambda x: grid.shift(x, 0))
    got = shift(_floats(grid.rank))
    assert got.dtype == FLOAT
    np.testing.assert_array_equal(np.asarray(got), _floats(left).astype(FLOAT))
    got = shift(grid.rank)
    assert got.dtype == INT and int(got) == left

    def fenced(x):
        grid.barrier()
        return grid.bcast(x, root=0)

    got = (jax.jit(fenced) if jit else fenced)(grid.rank + 1.0)
    assert got.dtype == FLOAT and float(got) == 1.0
    grid.free()


@pytest.mark.mpi
def test_kernels_move_default_dtypes(jc, capfd):
    rank, size = jc.rank, jc.size
    left, right = (rank - 1) % size, (rank + 1) % size
    with mpi_debug():
        jax.block_until_ready(jc.allreduce(_floats(rank)))
        jax.block_until_ready(jc.allgatherv(_ints(rank, 2), jnp.full(size, 2)))
        jax.block_until_ready(jc.sendrecv(1.0, np.zeros(()), source=left, dest=right))
    log = [line for line in capfd.readouterr().err.splitlines() if line.startswith("r")]
    assert log == [
        f"r{rank} | MPI_Allreduce op SUM count 4 {FLOAT}",
        f"r{rank} | MPI_Allgatherv count 2 {INT}",
        f"r{rank} | MPI_Sendrecv -> {right} tag 0 count 1 {FLOAT} "
        f"<- {left} tag any count 1 {FLOAT}",
    ]


@pytest.mark.mpi
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_pytrees_of_default_dtypes(jc, jit):
    rank, size = jc.rank, jc.size
    tree = {"w": _floats(rank), "n": np.int64(rank), "lr": 0.5, "steps": [rank, 2]}
    allreduce = jax.jit(jc.allreduce) if jit else jc.allreduce
    out = allreduce(tree)
    dtypes = {k: np.dtype(v.dtype) for k, v in out.items() if k != "steps"}
    assert dtypes == {"w": FLOAT, "n": INT, "lr": FLOAT}
    assert [leaf.dtype for leaf in out["steps"]] == [INT, INT]
    np.testing.assert_array_equal(out["w"], sum(_floats(r) for r in range(size)).astype(FLOAT))
    assert int(out["n"]) == sum(range(size)) and float(out["lr"]) == 0.5 * size
    assert [int(v) for v in out["steps"]] == [sum(range(size)), 2 * size]
    bcast = jax.jit(lambda t: jc.bcast(t, root=0)) if jit else (lambda t: jc.bcast(t, root=0))
    out = bcast(tree)
    assert np.dtype(out["w"].dtype) == FLOAT and np.dtype(out["n"].dtype) == INT
    np.testing.assert_array_equal(out["w"], _floats(0).astype(FLOAT))
    assert int(out["n"]) == 0 and [int(v) for v in out["steps"]] == [0, 2]


@pytest.mark.mpi
def test_derivatives_in_default_dtypes(jc):
    rank, size = jc.rank, jc.size
    x = _floats(rank)
    total = sum(_floats(r) for r in range(size))

    # allreduce transposes to the identity: d/dx sum(allreduce(x) * x) = total + x.
    loss = lambda x: jnp.sum(jc.allreduce(x) * x)
    for grad in (jax.grad(loss), jax.jit(jax.grad(loss))):
        g = grad(x)
        assert g.dtype == FLOAT
        np.testing.assert_allclose(g, total + x, rtol=1e-6)

    # A Python-float primal: its gradient is a scalar of the default dtype.
    g = jax.grad(lambda s: jc.allreduce(s * 2.0))(float(rank))
    assert g.dtype == FLOAT and float(g) == 2.0

    stacked = np.stack([_floats(r) for r in range(size)])
    primal, tangent = jax.jvp(jc.allgather, (x,), (np.ones(4),))
    assert primal.dtype == tangent.dtype == FLOAT
    np.testing.assert_array_equal(primal, stacked.astype(FLOAT))
    np.testing.assert_array_equal(tangent, np.ones((size, 4)))

    left, right = (rank - 1) % size, (rank + 1) % size
    ring = lambda x: jc.sendrecv(x, np.zeros(4), source=left, dest=right)
    g = jax.jit(jax.grad(lambda x: jnp.sum(ring(x) * (rank + 1))))(x)
    assert g.dtype == FLOAT
    # The cotangent of what this rank sent right comes back from the right.
    np.testing.assert_array_equal(g, np.full(4, right + 1.0))


@pytest.mark.mpi
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_vmap_in_default_dtypes(jc, jit):
    rank, size = jc.rank, jc.size
    batch = np.stack([_floats(rank) + b for b in range(3)])
    allreduce = jax.vmap(jc.allreduce)
    bcast = jax.vmap(lambda x: jc.bcast(x, root=size - 1))
    if jit:
        allreduce, bcast = jax.jit(allreduce), jax.jit(bcast)
    got = allreduce(batch)
    assert got.dtype == FLOAT
    want = np.stack([sum(_floats(r) + b for r in range(size)) for b in range(3)])
    np.testing.assert_array_equal(got, want.astype(FLOAT))
    got = bcast(np.arange(3) + rank)
    assert got.dtype == INT
    np.testing.assert_array_equal(got, np.arange(3) + size - 1)
