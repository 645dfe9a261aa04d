"""Large messages: the chunking and derived-datatype paths, forced with a small cap.

Counts above MPI's int limit go through the same code as counts above the
cap set here, so a cap of a few elements exercises them on small arrays.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import mpi_debug, not_reported_again, rank_data
from mpi4py import MPI

from jaxcomm._runtime import _kernels_cpu

CAP = 7


@pytest.fixture
def small_cap():
    previous = _kernels_cpu.max_count()
    _kernels_cpu.set_max_count(CAP)
    try:
        yield CAP
    finally:
        _kernels_cpu.set_max_count(previous)


# 6 fits one call, 45 = 6 * 7 + 3 leaves a remainder, 49 = 7 * 7 does not.
SIZES = [6, 45, 49]


def total(size, n, dtype, op):
    """The reduction of every rank's rank_data under SUM (LOR for bool)."""
    want = np.zeros(n, dtype)
    for r in range(size):
        data = rank_data(r, (n,), dtype)
        want = want | data if op == MPI.LOR else want + data
    return want


@pytest.mark.mpi
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", ["float32", "int64", "float16", "complex128", "bool"])
def test_chunked_allreduce_and_bcast(jc, small_cap, n, dtype):
    dtype = np.dtype(dtype)
    op = MPI.LOR if dtype == np.dtype(bool) else MPI.SUM
    x = rank_data(jc.rank, (n,), dtype)
    want = total(jc.size, n, dtype, op)
    np.testing.assert_array_equal(np.asarray(jc.allreduce(x, op=op)), want)
    for root in range(jc.size):
        got = jax.jit(lambda v, root=root: jc.bcast(v, root=root))(jnp.asarray(x))
        np.testing.assert_array_equal(np.asarray(got), rank_data(root, (n,), dtype))


@pytest.mark.mpi
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", ["float32", "int64", "bfloat16", "bool"])
def test_chunked_reduce_scan_exscan(jc, small_cap, n, dtype):
    dtype = np.dtype(jnp.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    op = MPI.LOR if dtype == np.dtype(bool) else MPI.SUM
    rank, size = jc.rank, jc.size
    x = rank_data(rank, (n,), dtype)

    @jax.jit
    def every_call(v):
        roots = [jc.reduce(v, op=op, root=root) for root in range(size)]
        return roots, jc.scan(v, op=op), jc.exscan(v, op=op)

    roots, scan, exscan = every_call(jnp.asarray(x))
    for root, got in enumerate(roots):
        want = total(size, n, dtype, op) if rank == root else np.zeros(n, dtype)
        np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(np.asarray(scan), total(rank + 1, n, dtype, op))
    np.testing.assert_array_equal(np.asarray(exscan), total(rank, n, dtype, op))


@pytest.mark.mpi
@pytest.mark.parametrize("block", [(6,), (3, 15), (7, 7)], ids=str)
@pytest.mark.parametrize("tiled", [False, True], ids=["stacked", "tiled"])
def test_chunked_reduce_scatter(jc, small_cap, block, tiled):
    # Each rank's block has one of SIZES elements: 6 goes through
    # MPI_Reduce_scatter_block, 45 and 49 reduce block by block onto each owner.
    rank, size = jc.rank, jc.size
    shape = (size * block[0], *block[1:]) if tiled else (size, *block)
    n = int(np.prod(shape))
    x = rank_data(rank, (n,), np.float64).reshape(shape)
    got = jax.jit(lambda v: jc.reduce_scatter(v, tiled=tiled))(jnp.asarray(x))
    want = total(size, n, np.float64, MPI.SUM).reshape(size, *block)[rank]
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.x64
@pytest.mark.mpi
@pytest.mark.parametrize("n", SIZES)
def test_large_type_p2p_and_status(jc, small_cap, n):
    right, left = (jc.rank + 1) % jc.size, (jc.rank - 1) % jc.size
    x = rank_data(jc.rank, (n,), np.float64)
    status = MPI.Status()
    y = jc.sendrecv(x, x, source=left, dest=right, status=status)
    np.testing.assert_array_equal(np.asarray(y), rank_data(left, (n,), np.float64))
    assert status.Get_count(MPI.DOUBLE) == n
    if jc.size >= 2:
        if jc.rank == 0:
            jc.send(x, 1, tag=4)
        elif jc.rank == 1:
            got = jc.recv(x, source=MPI.ANY_SOURCE, tag=4, status=status)
            np.testing.assert_array_equal(np.asarray(got), rank_data(0, (n,), np.float64))
            assert (status.source, status.Get_count(MPI.BYTE)) == (0, x.nbytes)


@pytest.mark.mpi
def test_chunks_are_separate_mpi_calls(jc, small_cap, capfd):
    with mpi_debug():
        jc.allreduce(jnp.ones(50, jnp.float32)).block_until_ready()
        jc.bcast(jnp.ones(50, jnp.float32), root=0).block_until_ready()
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("r")]
    counts = [int(line.split("count ")[1].split()[0]) for line in lines if "Allreduce" in line]
    assert counts == [7] * 7 + [1]
    # Data movement stays one call, with one derived datatype spanning it all.
    assert [line for line in lines if "Bcast" in line] == [
        f"r{jc.rank} | MPI_Bcast root 0 count 50 float32"
    ]


@pytest.mark.mpi
def test_chunked_reduction_family_calls(jc, small_cap, capfd):
    size = jc.size
    with mpi_debug():
        jc.reduce(jnp.ones(50, jnp.float32), root=size - 1).block_until_ready()
        jc.scan(jnp.ones(50, jnp.float32)).block_until_ready()
        jc.exscan(jnp.ones(50, jnp.float32)).block_until_ready()
        jc.reduce_scatter(jnp.ones((size, 6), jnp.float32)).block_until_ready()
        jc.reduce_scatter(jnp.ones((size, 10), jnp.float32)).block_until_ready()
    lines = [line.split(" | ")[1] for line in capfd.readouterr().err.splitlines() if " | " in line]
    pieces = ["count 7 float32"] * 7 + ["count 1 float32"]
    assert lines[:8] == [f"MPI_Reduce op SUM root {size - 1} {p}" for p in pieces]
    assert lines[8:16] == [f"MPI_Scan op SUM {p}" for p in pieces]
    assert lines[16:24] == [f"MPI_Exscan op SUM {p}" for p in pieces]
    # A block within the cap is one call whatever the whole array's size.
    assert lines[24] == "MPI_Reduce_scatter_block op SUM count 6 float32"
    assert lines[25:] == [
        f"MPI_Reduce op SUM root {r} count {n} float32" for r in range(size) for n in (7, 3)
    ]


@pytest.mark.mpi
def test_beyond_what_one_call_can_describe_is_a_clear_error(jc, small_cap):
    # cap * (cap + 1) - 1 elements is the most one derived datatype spans
    # (about 2**62 with the real cap).
    x = jnp.zeros(CAP * (CAP + 1))
    with pytest.raises(RuntimeError, match="56 elements exceed the 55 elements"):
        jc.bcast(x, root=0).block_until_ready()
    not_reported_again()
    np.testing.assert_array_equal(jc.bcast(x[:55], root=0), np.zeros(55))


def test_cap_is_clamped():
    previous = _kernels_cpu.max_count()
    try:
        _kernels_cpu.set_max_count(0)
        assert _kernels_cpu.max_count() == 1
        _kernels_cpu.set_max_count(2**40)
        assert _kernels_cpu.max_count() == 2**31 - 1
    finally:
        _kernels_cpu.set_max_count(previous)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ["float16", "float32", "complex128", "bool"])
def test_gather_family_large_blocks(jc, small_cap, dtype):
    # Blocks of 45 = 6 * 7 + 3 elements move as one derived-datatype element
    # each, whose extent must be the whole block for block r to land at r * 45.
    size, rank, n = jc.size, jc.rank, 45
    dtype = np.dtype(dtype)
    x = rank_data(rank, (n,), dtype)
    big = rank_data(rank, (size * n,), dtype)

    @jax.jit
    def run(x, big):
        return (
            jc.allgather(x, tiled=True),
            [jc.gather(x, root) for root in range(size)],
            [jc.scatter(big, root, tiled=True) for root in range(size)],
            jc.alltoall(big, tiled=True),
        )

    allgathered, gathered, scattered, exchanged = run(x, big)
    everyone = np.concatenate([rank_data(r, (n,), dtype) for r in range(size)])
    np.testing.assert_array_equal(np.asarray(allgathered), everyone)
    for root in range(size):
        want = everyone.reshape(size, n) if rank == root else np.zeros((size, n), dtype)
        np.testing.assert_array_equal(np.asarray(gathered[root]), want)
        want = np.split(rank_data(root, big.shape, dtype), size)[rank]
        np.testing.assert_array_equal(np.asarray(scattered[root]), want)
    want = [np.split(rank_data(i, big.shape, dtype), size)[rank] for i in range(size)]
    np.testing.assert_array_equal(np.asarray(exchanged), np.concatenate(want))


@pytest.mark.mpi
@pytest.mark.parametrize("n", SIZES)
def test_nonblocking_reductions_past_the_cap(jc, small_cap, n, capfd):
    # Predefined reductions take no derived datatype: past the cap the
    # nonblocking reductions start one MPI call per piece, as the blocking
    # ones make, and the wait completes them all.
    size, rank = jc.size, jc.rank
    x = jnp.asarray(rank_data(rank, (n,), np.float32))
    with mpi_debug():
        summed, reduced, scanned = jc.waitall([jc.iallreduce(x), jc.ireduce(x), jc.iscan(x)])
    want = total(size, n, np.float32, MPI.SUM)
    np.testing.assert_array_equal(np.asarray(summed), want)
    np.testing.assert_array_equal(np.asarray(reduced), want if rank == 0 else 0 * want)
    np.testing.assert_array_equal(np.asarray(scanned), total(rank + 1, n, np.float32, MPI.SUM))
    lines = [line.split(" | ")[1] for line in capfd.readouterr().err.splitlines() if " | " in line]
    counts = [CAP] * (n // CAP) + ([n % CAP] if n % CAP else [])
    assert [line for line in lines if line.startswith("MPI_Iallreduce")] == [
        f"MPI_Iallreduce op SUM count {c} float32" for c in counts
    ]


@pytest.mark.mpi
def test_nonblocking_blocks_past_the_cap(jc, small_cap):
    # The block starts move blocks of 45 elements as one derived-datatype
    # element each; ialltoallv, whose int displacements no datatype widens,
    # counts rows of 8 elements instead, and refuses more rows than an int.
    size, rank, n = jc.size, jc.rank, 45
    x = rank_data(rank, (n,), np.float32)
    big = rank_data(rank, (size * n,), np.float32)
    matrix = [[(i + j) % 3 + 1 for j in range(size)] for i in range(size)]
    rows = rank_data(rank, (sum(matrix[rank]), 8), np.float32)

    @jax.jit
    def run(x, big, rows):
        return jc.waitall(
            [
                jc.igather(x, size - 1, tiled=True),
                jc.iscatter(big, 0, tiled=True),
                jc.ialltoall(big, tiled=True),
                jc.ialltoallv(rows, matrix[rank], [row[rank] for row in matrix]),
            ]
        )

    gathered, scattered, exchanged, received = run(x, big, rows)
    everyone = np.concatenate([rank_data(r, (n,), np.float32) for r in range(size)])
    np.testing.assert_array_equal(gathered, everyone if rank == size - 1 else 0 * everyone)
    np.testing.assert_array_equal(
        scattered, np.split(rank_data(0, big.shape, np.float32), size)[rank]
    )
    want = [np.split(rank_data(i, big.shape, np.float32), size)[rank] for i in range(size)]
    np.testing.assert_array_equal(exchanged, np.concatenate(want))
    want = [
        _split(rank_data(i, (sum(matrix[i]), 8), np.float32), matrix[i])[rank] for i in range(size)
    ]
    np.testing.assert_array_equal(received, np.concatenate(want))
    # Every rank sends itself 8 rows: more than the cap counts, on every rank alike.
    own = [8 if r == rank else 0 for r in range(size)]
    with pytest.raises(
        RuntimeError, match="8 rows are more than one nonblocking alltoallv can count"
    ):
        jc.wait(jc.ialltoallv(jnp.zeros((8, 1)), own, own))
    not_reported_again()


def _large_counts(size):
    """Rows per rank, past the cap of 7 elements, with an empty rank when size > 1."""
    return [0 if r % 3 == 1 else 8 + r for r in range(size)]


def _large_matrix(size):
    return [[0 if (i + j) % 3 == 1 else 8 + i + j for j in range(size)] for i in range(size)]


def _split(array, counts):
    return np.split(array, np.cumsum(counts)[:-1])


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ["float16", "complex128", "bool"])
def test_v_ops_past_the_cap(jc, small_cap, dtype):
    size, rank = jc.size, jc.rank
    dtype = np.dtype(dtype)
    counts, matrix = _large_counts(size), _large_matrix(size)
    x = rank_data(rank, (counts[rank], 2), dtype)
    whole = rank_data(rank, (sum(counts), 2), dtype)
    mine = rank_data(rank, (sum(matrix[rank]), 2), dtype)

    @jax.jit
    def run(x, whole, mine):
        return (
            jc.allgatherv(x, counts),
            [jc.gatherv(x, counts, root) for root in range(size)],
            [jc.scatterv(whole, counts, root) for root in range(size)],
            jc.alltoallv(mine, matrix),
        )

    allgathered, gathered, scattered, received = run(x, whole, mine)
    everyone = np.concatenate([rank_data(r, (counts[r], 2), dtype) for r in range(size)])
    np.testing.assert_array_equal(np.asarray(allgathered), everyone)
    for root in range(size):
        want = everyone if rank == root else np.zeros_like(everyone)
        np.testing.assert_array_equal(np.asarray(gathered[root]), want)
        want = _split(rank_data(root, whole.shape, dtype), counts)[rank]
        np.testing.assert_array_equal(np.asarray(scattered[root]), want)
    want = [_split(rank_data(i, (sum(matrix[i]), 2), dtype), matrix[i])[rank] for i in range(size)]
    np.testing.assert_array_equal(np.asarray(received), np.concatenate(want))


@pytest.mark.mpi
def test_gather_family_calls_past_the_cap(jc, small_cap, capfd):
    size, rank = jc.size, jc.rank
    # Counts and displacements of at most 7 elements: one MPI call each.
    fits = [7 // size] * size
    large = _large_counts(size)
    with mpi_debug():
        jc.allgather(jnp.ones(50, jnp.float32)).block_until_ready()
        for counts in (fits, large):
            x = jnp.ones(counts[rank], jnp.float32)
            whole = jnp.ones(sum(counts), jnp.float32)
            jc.allgatherv(x, counts).block_until_ready()
            jc.gatherv(x, counts, root=0).block_until_ready()
            jc.scatterv(whole, counts, root=0).block_until_ready()
            jc.alltoallv(whole, [counts] * size).block_until_ready()
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("r")]
    whole = sum(large)
    assert lines == [
        f"r{rank} | MPI_Allgather count 50 float32",
        f"r{rank} | MPI_Allgatherv count {fits[rank]} float32",
        f"r{rank} | MPI_Gatherv root 0 count {fits[rank]} float32",
        f"r{rank} | MPI_Scatterv root 0 count {7 // size * size} float32",
        f"r{rank} | MPI_Alltoallv count {7 // size * size} float32",
        # allgatherv: one broadcast from each rank that has rows.
        *(f"r{rank} | MPI_Bcast root {r} count {c} float32" for r, c in enumerate(large) if c),
        f"r{rank} | MPI_Alltoallw count {large[rank]} float32",
        f"r{rank} | MPI_Alltoallw count {whole} float32",
        f"r{rank} | MPI_Alltoallw count {whole} float32",
    ]
