"""Gather family: allgather, gather, scatter, alltoall and the *v forms.

Expected values come from numpy and ``size``; every rank passes its own data,
so results show whose values travelled where.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ALL_DTYPES, SHAPES, mpi_debug, rank_data, unchanged, unmonitored


def _split(array, counts):
    """``array`` cut along its leading axis into blocks of ``counts`` rows."""
    return np.split(array, np.cumsum(counts)[:-1])


def _stacked(size, shape, dtype, tiled):
    parts = [rank_data(r, shape, dtype) for r in range(size)]
    return np.concatenate(parts) if tiled else np.stack(parts)


def _counts_matrix(size):
    """Uneven rows from rank i to rank j, with some empty blocks."""
    return [[(2 * i + j) % 3 for j in range(size)] for i in range(size)]


# Per-rank rows (uneven, all empty, empty on some ranks only) and row shapes.
COUNTS = [
    pytest.param(lambda size: [r + 1 for r in range(size)], (3, 2), id="uneven"),
    pytest.param(lambda size: [0] * size, (), id="empty"),
    pytest.param(lambda size: [2 * (r % 2) for r in range(size)], (), id="some-empty"),
]


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_fixed_size_ops_every_dtype_and_root_jit(jc, dtype):
    size, rank = jc.size, jc.rank
    x = rank_data(rank, (2, 3), dtype)
    blocks = rank_data(rank, (size, 2), dtype)

    # One compiled function for every root keeps compile time down.
    @jax.jit
    def run(x, blocks):
        return (
            [jc.allgather(x, tiled=tiled) for tiled in (False, True)],
            [jc.gather(x, root=root) for root in range(size)],
            [jc.scatter(blocks, root=root) for root in range(size)],
            jc.alltoall(blocks),
        )

    allgathered, gathered, scattered, exchanged = run(x, blocks)
    for tiled, y in zip((False, True), allgathered):
        assert y.dtype == dtype
        np.testing.assert_array_equal(np.asarray(y), _stacked(size, (2, 3), dtype, tiled))
    want = _stacked(size, (2, 3), dtype, False)
    for root in range(size):
        np.testing.assert_array_equal(
            np.asarray(gathered[root]), want if rank == root else np.zeros_like(want)
        )
        np.testing.assert_array_equal(
            np.asarray(scattered[root]), rank_data(root, (size, 2), dtype)[rank]
        )
    want = np.stack([rank_data(i, (size, 2), dtype)[rank] for i in range(size)])
    np.testing.assert_array_equal(np.asarray(exchanged), want)
    unchanged(x, rank_data(rank, (2, 3), dtype))
    unchanged(blocks, rank_data(rank, (size, 2), dtype))


@pytest.mark.mpi
@pytest.mark.parametrize(
    "shape,tiled",
    # tiled needs a leading axis to concatenate or split.
    [(shape, tiled) for shape in SHAPES for tiled in (False, True) if shape or not tiled],
    ids=str,
)
@pytest.mark.parametrize("dtype", ["float32", "bool"])
def test_fixed_size_ops_shapes_jit(jc, dtype, shape, tiled):
    size, rank = jc.size, jc.rank
    dtype = np.dtype(dtype)
    x = jnp.asarray(rank_data(rank, shape, dtype))
    # What every rank passes to scatter and alltoall: allgather's output shape.
    big_shape = _stacked(size, shape, dtype, tiled).shape
    big = jnp.asarray(rank_data(rank, big_shape, dtype))
    gathered = _stacked(size, shape, dtype, tiled)

    @jax.jit
    def run(x, big):
        return (
            jc.allgather(x, tiled=tiled),
            [jc.gather(x, root, tiled=tiled) for root in range(size)],
            [jc.scatter(big, root, tiled=tiled) for root in range(size)],
            jc.alltoall(big, tiled=tiled),
        )

    allgathered, gathered_at, scattered, exchanged = run(x, big)
    np.testing.assert_array_equal(np.asarray(allgathered), gathered)
    for root in range(size):
        np.testing.assert_array_equal(
            np.asarray(gathered_at[root]), gathered if rank == root else np.zeros_like(gathered)
        )
        sent = rank_data(root, big_shape, dtype)
        want = np.split(sent, size)[rank] if tiled else sent[rank]
        np.testing.assert_array_equal(np.asarray(scattered[root]), want)
    assert exchanged.shape == big.shape
    sent = [rank_data(i, big_shape, dtype) for i in range(size)]
    want = (
        np.concatenate([np.split(s, size)[rank] for s in sent])
        if tiled
        else np.stack([s[rank] for s in sent])
    )
    np.testing.assert_array_equal(np.asarray(exchanged), want)
    unchanged(x, rank_data(rank, shape, dtype))
    unchanged(big, rank_data(rank, big_shape, dtype))


@pytest.mark.mpi
@pytest.mark.parametrize("tiled", [False, True])
def test_fixed_size_ops_eager(jc, tiled):
    size, rank = jc.size, jc.rank
    x = rank_data(rank, (2,), np.int32)
    gathered = _stacked(size, (2,), np.int32, tiled)
    big = rank_data(rank, gathered.shape, np.int32)
    np.testing.assert_array_equal(jc.allgather(x, tiled=tiled), gathered)
    for root in range(size):
        y = jc.gather(x, root, tiled=tiled)
        np.testing.assert_array_equal(y, gathered if rank == root else np.zeros_like(gathered))
        y = jc.scatter(big, root, tiled=tiled)
        want = np.split(rank_data(root, big.shape, np.int32), size)[rank]
        np.testing.assert_array_equal(y, want.reshape(y.shape))
    y = jc.alltoall(big, tiled=tiled)
    want = [np.split(rank_data(i, big.shape, np.int32), size)[rank] for i in range(size)]
    np.testing.assert_array_equal(y, np.concatenate(want).reshape(big.shape))
    unchanged(x, rank_data(rank, (2,), np.int32))
    unchanged(big, rank_data(rank, big.shape, np.int32))


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_v_ops_every_dtype_jit(jc, dtype):
    size, rank = jc.size, jc.rank
    counts = [r + 1 for r in range(size)]
    matrix = _counts_matrix(size)
    x = rank_data(rank, (counts[rank], 2), dtype)
    whole = rank_data(rank, (sum(counts), 2), dtype)
    mine = rank_data(rank, (sum(matrix[rank]), 2), dtype)
    gathered = np.concatenate([rank_data(r, (counts[r], 2), dtype) for r in range(size)])
    exchanged = np.concatenate(
        [_split(rank_data(i, (sum(matrix[i]), 2), dtype), matrix[i])[rank] for i in range(size)]
    )

    @jax.jit
    def run(x, whole, mine):
        return (
            jc.allgatherv(x, counts),
            [jc.gatherv(x, counts, root=root) for root in range(size)],
            [jc.scatterv(whole, counts, root=root) for root in range(size)],
            jc.alltoallv(mine, matrix),
        )

    allgathered, gathered_at, scattered, received = run(x, whole, mine)
    np.testing.assert_array_equal(np.asarray(allgathered), gathered)
    for root in range(size):
        np.testing.assert_array_equal(
            np.asarray(gathered_at[root]), gathered if rank == root else np.zeros_like(gathered)
        )
        np.testing.assert_array_equal(
            np.asarray(scattered[root]),
            _split(rank_data(root, (sum(counts), 2), dtype), counts)[rank],
        )
    np.testing.assert_array_equal(np.asarray(received), exchanged)
    unchanged(x, rank_data(rank, (counts[rank], 2), dtype))
    unchanged(whole, rank_data(rank, (sum(counts), 2), dtype))


@pytest.mark.mpi
@pytest.mark.parametrize("make_counts,trailing", COUNTS)
def test_v_ops_counts_eager(jc, make_counts, trailing):
    size, rank = jc.size, jc.rank
    counts = make_counts(size)
    x = rank_data(rank, (counts[rank], *trailing), np.float64)
    whole = rank_data(rank, (sum(counts), *trailing), np.float64)
    gathered = np.concatenate(
        [rank_data(r, (counts[r], *trailing), np.float64) for r in range(size)]
    )
    y = jc.allgatherv(x, counts)
    assert y.shape == (sum(counts), *trailing)
    np.testing.assert_array_equal(np.asarray(y), gathered)
    for root in range(size):
        y = jc.gatherv(x, counts, root=root)
        np.testing.assert_array_equal(
            np.asarray(y), gathered if rank == root else np.zeros_like(gathered)
        )
        y = jc.scatterv(whole, counts, root=root)
        assert y.shape == (counts[rank], *trailing)
        np.testing.assert_array_equal(
            np.asarray(y), _split(rank_data(root, whole.shape, np.float64), counts)[rank]
        )
    # Every rank sends counts[j] rows to rank j, so rank r gets counts[r]
    # rows from each rank.
    y = jc.alltoallv(whole, [counts] * size)
    want = np.concatenate(
        [_split(rank_data(i, whole.shape, np.float64), counts)[rank] for i in range(size)]
    )
    assert y.shape == (size * counts[rank], *trailing)
    np.testing.assert_array_equal(np.asarray(y), want)
    unchanged(x, rank_data(rank, (counts[rank], *trailing), np.float64))
    unchanged(whole, rank_data(rank, (sum(counts), *trailing), np.float64))


@pytest.mark.mpi
def test_scatter_example_from_the_docs(jc):
    y = jc.scatter(jnp.arange(2.0 * jc.size) * (jc.rank == 0), root=0, tiled=True)
    np.testing.assert_array_equal(y, [2.0 * jc.rank, 2.0 * jc.rank + 1])


@pytest.mark.mpi
def test_gather_family_in_fori_loop(jc):
    size, rank = jc.size, jc.rank
    counts = [r % 3 for r in range(size)]
    matrix = _counts_matrix(size)

    def root_branches(op):
        return [lambda v, r=r: op(v, r) for r in range(size)]

    gathers = root_branches(lambda v, r: jc.gather(v, r, tiled=True))
    scatters = root_branches(lambda v, r: jc.scatter(v, r, tiled=True))
    gathervs = root_branches(lambda v, r: jc.gatherv(v[: counts[rank]], counts, r))
    scattervs = root_branches(lambda v, r: jc.scatterv(v, counts, r))

    @jax.jit
    def loop(x):
        # Each iteration uses another root: a reordering would pair up
        # different roots across ranks.
        def body(i, acc):
            root = i % size
            total = jnp.sum(jc.allgather(x))
            total += jnp.sum(jc.alltoall(jc.allgather(x)))
            total += jnp.sum(jax.lax.switch(root, gathers, x))
            total += jnp.sum(jax.lax.switch(root, scatters, jc.allgather(x, tiled=True)))
            total += jnp.sum(jc.allgatherv(x[: counts[rank]], counts))
            total += jnp.sum(jax.lax.switch(root, gathervs, x))
            total += jnp.sum(jax.lax.switch(root, scattervs, jnp.ones(sum(counts))))
            total += jnp.sum(jc.alltoallv(jnp.ones(sum(matrix[rank])), matrix))
            return acc + total

        return jax.lax.fori_loop(0, 2 * size, body, 0.0)

    x = jnp.full(2, rank + 1.0)
    everyone = 2.0 * sum(r + 1 for r in range(size))
    per_iteration = {
        root: everyone  # allgather
        + size * x.sum()  # alltoall of the allgather: x from every rank
        + (everyone if rank == root else 0.0)  # gather
        + x.sum()  # scatter of the tiled allgather gives x back
        + sum((r + 1) * counts[r] for r in range(size))  # allgatherv
        + (sum((r + 1) * counts[r] for r in range(size)) if rank == root else 0.0)  # gatherv
        + counts[rank]  # scatterv of ones
        + sum(row[rank] for row in matrix)  # alltoallv of ones
        for root in range(size)
    }
    want = sum(per_iteration[i % size] for i in range(2 * size))
    np.testing.assert_allclose(float(loop(x)), want)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", ["gather", "gatherv", "igather"])
def test_zeros_off_root_follow_the_call_in_a_loop(jc, op):
    # A loop whose next carry comes from the zeros that a rank off root
    # gets. Those zeros are ordered after the call (jaxcomm_zero_after), so
    # the call reads the carry where it is: as a constant, unordered with the
    # call, they made XLA copy the carry for the call and copy the zeros into
    # the next carry, two passes over the message per iteration.
    # Only compiled, with a root that is another rank on every rank.
    size, root = jc.size, (jc.rank + 1) % jc.size
    calls = {
        "gather": lambda c: jc.gather(c, root=root),
        "gatherv": lambda c: jc.gatherv(c, [c.shape[0]] * size, root=root),
        "igather": lambda c: jc.wait(jc.igather(c, root=root)),
    }

    def loop(c):
        return jax.lax.fori_loop(0, 3, lambda i, c: calls[op](c).reshape(-1)[: c.size] * 0.5, c)

    hlo = jax.jit(loop).lower(jnp.ones(1 << 10, jnp.float32)).compile().as_text()
    computations = hlo.split("\n\n")
    (body,) = [text for text in computations if f'custom_call_target="jaxcomm_{op}' in text]
    assert 'custom_call_target="jaxcomm_zero_after"' in body, body
    # No copy of the message (the igather's wait copies its empty placeholder).
    assert not re.search(r"= f32\[1024\]\S* copy\(", body), body


@unmonitored
@pytest.mark.x64
@pytest.mark.mpi
def test_debug_log_lines(jc, capfd):
    size, rank = jc.size, jc.rank
    with mpi_debug():
        jc.allgather(jnp.ones(9, jnp.float32)).block_until_ready()
        jc.gather(jnp.ones(9, jnp.float32), root=0).block_until_ready()
        jc.scatter(jnp.ones((size, 2), jnp.float32), root=0).block_until_ready()
        jc.alltoall(jnp.ones((size, 2), jnp.int32)).block_until_ready()
        counts = [2] * size
        jc.allgatherv(jnp.ones(2), counts).block_until_ready()
        jc.gatherv(jnp.ones(2), counts, root=0).block_until_ready()
        jc.scatterv(jnp.ones(2 * size), counts, root=0).block_until_ready()
        jc.alltoallv(jnp.ones(2 * size), [counts] * size).block_until_ready()
    err = [line for line in capfd.readouterr().err.splitlines() if line.startswith("r")]
    assert err == [
        f"r{rank} | MPI_Allgather count 9 float32",
        f"r{rank} | MPI_Gather root 0 count 9 float32",
        f"r{rank} | MPI_Scatter root 0 count {2 * size} float32",
        f"r{rank} | MPI_Alltoall count {2 * size} int32",
        f"r{rank} | MPI_Allgatherv count 2 float64",
        f"r{rank} | MPI_Gatherv root 0 count 2 float64",
        f"r{rank} | MPI_Scatterv root 0 count {2 * size} float64",
        f"r{rank} | MPI_Alltoallv count {2 * size} float64",
    ]


def test_fixed_size_ops_reject_bad_input(jc):
    size = jc.size
    with pytest.raises(ValueError, match="x must have a leading axis"):
        jc.allgather(jnp.float32(1), tiled=True)
    with pytest.raises(ValueError, match="x must have a leading axis"):
        jc.gather(jnp.float32(1), tiled=True)
    with pytest.raises(TypeError, match="tiled must be a static bool"):
        jc.allgather(jnp.ones(2), tiled=1)
    with pytest.raises(TypeError, match="tiled must be a static bool"):
        jax.jit(lambda t: jc.allgather(jnp.ones(2), tiled=t))(True)
    for op in (jc.gather, jc.scatter):
        with pytest.raises(ValueError, match=f"root={size}"):
            op(jnp.ones(size), root=size)
        with pytest.raises(ValueError, match="root=-1"):
            op(jnp.ones(size), root=-1)
        with pytest.raises(TypeError, match="root must be a static Python int"):
            jax.jit(lambda r, op=op: op(jnp.ones(size), root=r))(0)
    for op in (jc.scatter, jc.alltoall):
        with pytest.raises(ValueError, match="x must have a leading axis"):
            op(jnp.float32(1))
        with pytest.raises(ValueError, match=f"x has leading axis {size + 1}; .* one entry"):
            op(jnp.ones(size + 1))
        if size > 1:
            with pytest.raises(ValueError, match=f"x has leading axis {2 * size + 1}, which"):
                op(jnp.ones(2 * size + 1), tiled=True)


def test_v_ops_reject_bad_counts(jc):
    size, rank = jc.size, jc.rank
    counts = [1] * size
    x = jnp.ones(1)
    for call in (
        lambda c: jc.allgatherv(x, c),
        lambda c: jc.gatherv(x, c),
        lambda c: jc.scatterv(jnp.ones(size), c),
    ):
        with pytest.raises(ValueError, match=f"counts has {size + 1} entries; .* \\({size}\\)"):
            call(counts + [1])
        with pytest.raises(ValueError, match=r"counts\[0\]=-1 is negative"):
            call([-1] + counts[1:])
        with pytest.raises(TypeError, match=r"counts\[0\] must be an int, got float"):
            call([1.0] + counts[1:])
        with pytest.raises(TypeError, match="counts must be a sequence, got int"):
            call(1)
        with pytest.raises(TypeError, match="counts must be a static sequence"):
            jax.jit(call)(jnp.asarray(counts))
        with pytest.raises(TypeError, match=r"counts\[0\] must be a static Python int"):
            jax.jit(lambda c, call=call: call([c, *counts[1:]]))(1)
    wrong_rows = rf"x has 2 rows on rank {rank}, but counts\[{rank}\] is 1"
    with pytest.raises(ValueError, match=wrong_rows):
        jc.allgatherv(jnp.ones(2), counts)
    with pytest.raises(ValueError, match="x must have a leading axis"):
        jc.gatherv(jnp.float32(1), counts)
    with pytest.raises(ValueError, match=f"root={size}"):
        jc.gatherv(x, counts, root=size)
    with pytest.raises(ValueError, match=f"x has {size + 1} rows, but counts add up to {size}"):
        jc.scatterv(jnp.ones(size + 1), counts)
    with pytest.raises(ValueError, match="root=-1"):
        jc.scatterv(jnp.ones(size), counts, root=-1)

    matrix = [counts] * size
    with pytest.raises(ValueError, match=f"counts has {size + 1} entries"):
        jc.alltoallv(jnp.ones(size), matrix + [counts])
    with pytest.raises(ValueError, match=rf"counts\[0\] has {size + 1} entries"):
        jc.alltoallv(jnp.ones(size), [counts + [1]] + matrix[1:])
    with pytest.raises(ValueError, match=r"counts\[0\]\[0\]=-1 is negative"):
        jc.alltoallv(jnp.ones(size), [[-1] + counts[1:]] + matrix[1:])
    # One count per rank is this rank's sendcounts, not a row of the matrix.
    _, received = jc.alltoallv(jnp.ones(size), [1] * size)
    np.testing.assert_array_equal(received, np.ones(size))
    with pytest.raises(ValueError, match=f"x has {size + 1} rows on rank {rank}, but counts"):
        jc.alltoallv(jnp.ones(size + 1), matrix)
    with pytest.raises(TypeError, match="counts must be a static sequence"):
        jax.jit(lambda c: jc.alltoallv(jnp.ones(size), c))(jnp.asarray(matrix))


def _planned_mib(fn, *args):
    """Temporaries plus outputs XLA plans for one call of ``jit(fn)``, in MiB."""
    analysis = jax.jit(fn).lower(*args).compile().memory_analysis()
    if analysis is None:
        pytest.skip("this jaxlib's CPU client reports no memory analysis")
    return (analysis.temp_size_in_bytes + analysis.output_size_in_bytes) / 2**20


@pytest.mark.mpi
@pytest.mark.parametrize("root", [0, -1], ids=["root0", "last"])
def test_rooted_ops_cost_off_root_ranks_no_memory_of_the_size(jc, root):
    # Off root, MPI ignores a gather's output and a scatter's input: the call
    # must not spend (size, ...) arrays there. Here root uses the gathered
    # result, and the scattered array is made inside the jitted function.
    size, rank = jc.size, jc.rank
    root %= size
    # The results stay the documented ones, with the zeros off root.
    got = jax.jit(
        lambda x: (jc.gather(x, root=root), jc.scatter(jnp.stack([x] * size) + rank, root=root))
    )
    gathered, scattered = got(jnp.full(3, float(rank)))
    np.testing.assert_array_equal(
        gathered, np.repeat(np.arange(size, dtype=np.float32)[:, None], 3, 1) * (rank == root)
    )
    np.testing.assert_array_equal(scattered, np.full(3, float(root + root)))
    got = jax.jit(
        lambda x: (
            jc.wait(jc.igather(x, root=root)),
            jc.wait(jc.iscatter(jnp.stack([x] * size) + rank, root=root)),
        )
    )
    gathered, scattered = got(jnp.full(3, float(rank)))
    np.testing.assert_array_equal(
        gathered, np.repeat(np.arange(size, dtype=np.float32)[:, None], 3, 1) * (rank == root)
    )
    np.testing.assert_array_equal(scattered, np.full(3, float(root + root)))

    x = jnp.zeros((1 << 16,), jnp.float32)  # 256 KiB
    mib = x.nbytes / 2**20
    counts = [x.shape[0]] * size
    plans = {
        "gather": _planned_mib(lambda x: jc.gather(x, root=root).sum(), x),
        "gatherv": _planned_mib(lambda x: jc.gatherv(x, counts, root=root).sum(), x),
        "scatter": _planned_mib(
            lambda x: jc.scatter(jnp.broadcast_to(x, (size, *x.shape)) + 1, root=root), x
        ),
        "scatterv": _planned_mib(
            lambda x: jc.scatterv(jnp.tile(x, size) + 1, counts, root=root), x
        ),
        "igather": _planned_mib(lambda x: jc.wait(jc.igather(x, root=root)).sum(), x),
        "iscatter": _planned_mib(
            lambda x: jc.wait(jc.iscatter(jnp.broadcast_to(x, (size, *x.shape)) + 1, root=root)),
            x,
        ),
    }
    if rank == root:
        # The whole gathered or scattered array: the measure sees it.
        assert all(planned >= size * mib for planned in plans.values()), plans
    else:
        # The piece this rank receives, and a few bytes of XLA's bookkeeping.
        assert all(planned <= mib + 4 / 1024 for planned in plans.values()), plans
