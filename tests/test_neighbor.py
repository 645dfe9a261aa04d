"""Neighbourhood collectives: neighbor_alltoall, neighbor_allgather, neighbor_alltoallv.

Every result is compared with a NumPy model of the exchange over random
distributed graphs, the same on every rank for one seed (empty in and out
lists, a rank with no neighbours at all, self-loops, duplicate edges), and
over Cartesian grids (periodic or not, 1-d and 2-d); eagerly and jitted,
with counts static or computed inside ``jit``. Derivatives are checked
against the model (the ops are linear) and finite differences, and every
transformation against a loop; bad input against the errors the docs
promise, followed by a collective that still matches on every rank.
"""

import itertools
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import RUNTIME_ERRORS, mpi_debug, not_reported_again, rank_data, unchanged
from mpi4py import MPI

import jaxcomm
from jaxcomm import JaxComm

SEEDS = range(4)


# The model ---------------------------------------------------------------------------


def random_graph(size, seed):
    """``(sources, destinations)``, each rank's lists, the same on every rank for one ``seed``.

    0 to 3 out-edges per rank to any rank (self-loops and duplicates
    included); with 2 ranks or more rank 1 sends nothing, and with 3 or more
    the last rank has no neighbours at all. Sources are shuffled.
    """
    rng = np.random.default_rng(seed)
    lonely = size - 1 if size >= 3 else None
    destinations = []
    for r in range(size):
        n = 0 if (r == 1 or r == lonely) else int(rng.integers(0, 4))
        targets = [int(t) for t in rng.integers(0, size, n)]
        destinations.append([t for t in targets if t != lonely])
    sources = [[] for _ in range(size)]
    for r, targets in enumerate(destinations):
        for t in targets:
            sources[t].append(r)
    sources = [[int(s) for s in rng.permutation(np.asarray(ss, np.int64))] for ss in sources]
    return sources, destinations


def landing(sources, destinations):
    """``land[r][j] = (d, i)``: block ``j`` of rank ``r`` arrives as block ``i`` on rank ``d``.

    The k-th edge from r to d matches the k-th time d lists r (MPI 4.1, 8.6.4).
    """
    land = [[None] * len(ds) for ds in destinations]
    for d, srcs in enumerate(sources):
        seen = {}
        for i, s in enumerate(srcs):
            k = seen.get(s, 0)
            seen[s] = k + 1
            j = [jj for jj, t in enumerate(destinations[s]) if t == d][k]
            land[s][j] = (d, i)
    return land


def model_alltoall(blocks, sources, destinations):
    """Every rank's neighbor_alltoall result for every rank's ``blocks`` (NumPy)."""
    shape, dtype = blocks[0].shape[1:], blocks[0].dtype
    out = [np.zeros((len(s), *shape), dtype) for s in sources]
    for r, row in enumerate(landing(sources, destinations)):
        for j, (d, i) in enumerate(row):
            out[d][i] = blocks[r][j]
    return out


def model_alltoallv(xs, sendcounts, sources, destinations, capacity):
    """Every rank's ``(y, recvcounts)`` of neighbor_alltoallv (NumPy)."""
    pieces = [[None] * len(s) for s in sources]
    for r, row in enumerate(landing(sources, destinations)):
        starts = np.concatenate([[0], np.cumsum(sendcounts[r])])
        for j, (d, i) in enumerate(row):
            pieces[d][i] = xs[r][starts[j] : starts[j + 1]]
    ys, counts = [], []
    for got in pieces:
        y = np.zeros((capacity, *xs[0].shape[1:]), xs[0].dtype)
        packed = np.concatenate([np.zeros((0, *xs[0].shape[1:]), xs[0].dtype), *got])
        y[: len(packed)] = packed
        ys.append(y)
        counts.append(np.array([len(p) for p in got], np.int32))
    return ys, counts


def grid_lists(dims, periods):
    """``(sources, destinations)`` of every rank of a Cartesian grid, from coordinates alone."""
    size = int(np.prod(dims))
    coords = list(itertools.product(*(range(d) for d in dims)))

    def rank_at(c):
        c = list(c)
        for d, (n, p) in enumerate(zip(dims, periods)):
            if not 0 <= c[d] < n:
                if not p:
                    return MPI.PROC_NULL
                c[d] %= n
        return coords.index(tuple(c))

    lists = []
    for r in range(size):
        ranks = []
        for d in range(len(dims)):
            for step in (-1, 1):
                c = list(coords[r])
                c[d] += step
                ranks.append(rank_at(c))
        lists.append(ranks)
    return lists


def model_grid(blocks, dims, periods):
    """Every rank's neighbor_alltoall result on a Cartesian grid (NumPy): zeros from PROC_NULL."""
    lists = grid_lists(dims, periods)
    out = []
    for r, ranks in enumerate(lists):
        y = np.zeros_like(blocks[r])
        for k, s in enumerate(ranks):
            if s != MPI.PROC_NULL:
                # The neighbour at -1 sent this way its block towards +1, and so on.
                y[k] = blocks[s][k ^ 1]
        out.append(y)
    return out


# Communicators ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def graphs(jc):
    """A ``from_graph`` JaxComm and its lists for every seed, made once for the module."""
    made = {}
    for seed in SEEDS:
        sources, destinations = random_graph(jc.size, seed)
        made[seed] = (
            JaxComm.from_graph(sources[jc.rank], destinations[jc.rank]),
            sources,
            destinations,
        )
    yield made
    for g, _, _ in made.values():
        g.free()


# Block widths (float32) on either side of the kernel's 64 KiB point-to-point
# limit: small blocks go as MPI_Isend/MPI_Irecv per edge (one MPI_Sendrecv for
# one edge each way), large ones to MPI's neighbourhood collective.
WIDTHS = [3, 17000]


GRIDS = {
    "ring": lambda size: ([size], [True]),
    "line": lambda size: ([size], [False]),
    "plane": lambda size: (MPI.Compute_dims(size, 2), [False, True]),
}


@pytest.fixture(scope="module")
def grids(jc):
    made = {name: JaxComm.from_cart(*shape(jc.size)) for name, shape in GRIDS.items()}
    yield made
    for g in made.values():
        g.free()


def _blocks_of(g_lists, rank, trailing, dtype, offset=0):
    return rank_data(rank + offset, (len(g_lists[rank]), *trailing), dtype)


def _total(jc, value):
    """The sum of a scalar over the ranks (mpi4py, outside jaxcomm's ordering)."""
    return jc.comm.allreduce(float(value))


def _still_matched(jc):
    np.testing.assert_array_equal(jc.allreduce(jnp.ones(2)), np.full(2, jc.size))


# neighbor_alltoallv, blocking or started and waited at once (ineighbor_alltoallv):
# the wait returns what the blocking call returns.
STARTED = pytest.mark.parametrize("started", [False, True], ids=["blocking", "started"])


def alltoallv_of(g, started):
    """``g.neighbor_alltoallv``, or ``ineighbor_alltoallv`` and its wait."""
    if not started:
        return g.neighbor_alltoallv
    return lambda *args, **kwargs: g.wait(g.ineighbor_alltoallv(*args, **kwargs))


# Construction -------------------------------------------------------------------------


@pytest.mark.mpi
@pytest.mark.parametrize("seed", SEEDS)
def test_from_graph_keeps_the_lists(jc, graphs, seed):
    g, sources, destinations = graphs[seed]
    assert g.sources == tuple(sources[jc.rank])
    assert g.destinations == tuple(destinations[jc.rank])
    assert isinstance(g.comm, MPI.Distgraphcomm)


@pytest.mark.mpi
def test_wrapping_a_topology_keeps_it(jc):
    sources, destinations = random_graph(jc.size, 1)
    comm = MPI.COMM_WORLD.Create_dist_graph_adjacent(sources[jc.rank], destinations[jc.rank])
    g = JaxComm(comm)
    assert g.sources == tuple(sources[jc.rank]) and g.destinations == tuple(destinations[jc.rank])
    blocks = [rank_data(r, (len(destinations[r]), 2), np.float32) for r in range(jc.size)]
    got = g.neighbor_alltoall(blocks[jc.rank])
    np.testing.assert_array_equal(got, model_alltoall(blocks, sources, destinations)[jc.rank])
    g.free()
    comm.Free()
    cart = MPI.COMM_WORLD.Create_cart([jc.size], periods=[True])
    g = JaxComm(cart)
    assert g.sources == g.destinations == ((jc.rank - 1) % jc.size, (jc.rank + 1) % jc.size)
    g.free()
    cart.Free()


@pytest.mark.mpi
def test_graphs_whose_lists_disagree_fail_every_rank(jc):
    # Every rank names rank 0 as a source, but nobody sends to it.
    with pytest.raises(ValueError, match="do not describe one graph"):
        JaxComm.from_graph([0], [])
    with pytest.raises(ValueError, match="not a rank of comm"):
        JaxComm.from_graph([], [jc.size])
    _still_matched(jc)


@pytest.mark.mpi
def test_a_communicator_without_neighbours_is_refused(jc):
    with pytest.raises(TypeError, match="no neighbours"):
        jc.neighbor_alltoall(jnp.ones((1, 2)))
    with pytest.raises(TypeError, match="no neighbours"):
        jc.sources  # noqa: B018


# Results ------------------------------------------------------------------------------


@pytest.mark.mpi
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("trailing", [(), (3,)])
@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.complex64, np.bool_])
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_alltoall_matches_the_model(jc, graphs, seed, trailing, dtype, mode):
    g, sources, destinations = graphs[seed]
    blocks = [_blocks_of(destinations, r, trailing, dtype) for r in range(jc.size)]
    want = model_alltoall(blocks, sources, destinations)[jc.rank]
    x = jnp.asarray(blocks[jc.rank])
    call = g.neighbor_alltoall if mode == "eager" else jax.jit(g.neighbor_alltoall)
    got = call(x)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got), want)
    unchanged(x, blocks[jc.rank])


@pytest.mark.mpi
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("width", WIDTHS)
def test_small_blocks_go_per_edge_and_large_ones_to_mpi_s_collective(
    jc, graphs, seed, width, capfd
):
    g, sources, destinations = graphs[seed]
    blocks = [_blocks_of(destinations, r, (width,), np.float32) for r in range(jc.size)]
    want = model_alltoall(blocks, sources, destinations)[jc.rank]
    x = jnp.asarray(blocks[jc.rank])
    gx = jnp.asarray(rank_data(jc.rank, (width,), np.float32))
    capfd.readouterr()
    with mpi_debug():
        got = jax.block_until_ready(g.neighbor_alltoall(x))
        got_gathered = jax.block_until_ready(g.neighbor_allgather(gx))
    lines = [line for line in capfd.readouterr().err.splitlines() if " | MPI_Neighbor_" in line]
    np.testing.assert_array_equal(np.asarray(got), want)
    gathered = [
        np.broadcast_to(rank_data(r, (width,), np.float32), (len(destinations[r]), width))
        for r in range(jc.size)
    ]
    want_gathered = model_alltoall(gathered, sources, destinations)[jc.rank]
    np.testing.assert_array_equal(np.asarray(got_gathered), want_gathered)
    # One edge each way: one MPI_Sendrecv; on every rank: at every size.
    one_each = len(sources[jc.rank]) == 1 and len(destinations[jc.rank]) == 1
    everywhere = all(len(s) == 1 and len(d) == 1 for s, d in zip(sources, destinations))
    per_edge = width * 4 <= 64 * 1024 or everywhere
    how = "as MPI_Sendrecv" if one_each else "as MPI_Isend and MPI_Irecv per edge"
    assert len(lines) == 2
    assert all(line.endswith(how) == per_edge for line in lines)
    assert not any(line.endswith("per edge" if one_each else "MPI_Sendrecv") for line in lines)


@pytest.mark.mpi
@pytest.mark.parametrize("width", WIDTHS)
def test_one_neighbour_each_way_is_one_sendrecv_at_every_size(jc, ring, width, capfd):
    # On a ring graph every rank has one source and one destination.
    behind = (jc.rank - 1) % jc.size
    x = jnp.asarray(rank_data(jc.rank, (1, width), np.float32))
    capfd.readouterr()
    with mpi_debug():
        got = jax.block_until_ready(jax.jit(ring.neighbor_alltoall)(x))
        y, received = jax.block_until_ready(ring.neighbor_alltoallv(x, [1]))
    lines = [line for line in capfd.readouterr().err.splitlines() if " | MPI_Neighbor_" in line]
    np.testing.assert_array_equal(got, rank_data(behind, (1, width), np.float32))
    np.testing.assert_array_equal(y, rank_data(behind, (1, width), np.float32))
    np.testing.assert_array_equal(received, [1])
    # neighbor_alltoall, then neighbor_alltoallv's header and its rows (MPI's call).
    assert len(lines) == 3
    assert lines[0].endswith("as MPI_Sendrecv") and lines[1].endswith("as MPI_Sendrecv")
    assert "MPI_Neighbor_alltoallv " in lines[2]
    _still_matched(jc)


@pytest.mark.mpi
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", [(), (2, 3)])
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_allgather_matches_the_model(jc, graphs, seed, shape, mode):
    g, sources, destinations = graphs[seed]
    xs = [rank_data(r, shape, np.float32) for r in range(jc.size)]
    blocks = [np.broadcast_to(xs[r], (len(destinations[r]), *shape)) for r in range(jc.size)]
    want = model_alltoall(blocks, sources, destinations)[jc.rank]
    call = g.neighbor_allgather if mode == "eager" else jax.jit(g.neighbor_allgather)
    got = call(xs[jc.rank])
    assert got.shape == (len(sources[jc.rank]), *shape)
    np.testing.assert_array_equal(np.asarray(got), want)


def _counts(destinations, seed):
    """Random rows per edge, 0 to 3, the same on every rank."""
    rng = np.random.default_rng(seed + 100)
    return [rng.integers(0, 4, len(ds)).astype(np.int32) for ds in destinations]


@pytest.mark.mpi
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("form", ["learned", "recvcounts", "static"])
@pytest.mark.parametrize("mode", ["eager", "jit"])
@STARTED
def test_alltoallv_matches_the_model(jc, graphs, seed, form, mode, started):
    g, sources, destinations = graphs[seed]
    exchange = alltoallv_of(g, started)
    sendcounts = _counts(destinations, seed)
    rows = max(int(c.sum()) for c in sendcounts) + 1
    xs = [rank_data(r, (rows, 2), np.float32) for r in range(jc.size)]
    capacity = 13
    ys, counts = model_alltoallv(xs, sendcounts, sources, destinations, capacity)
    send = sendcounts[jc.rank]

    def call(x, send):
        if form == "learned":
            return exchange(x, send, capacity=capacity)
        if form == "recvcounts":
            return exchange(x, send, counts[jc.rank], capacity=capacity)
        return exchange(x, send.tolist(), counts[jc.rank].tolist(), capacity=capacity)

    x = jnp.asarray(xs[jc.rank])
    if mode == "jit":
        if form == "static":
            got = jax.jit(lambda x: call(x, send))(x)
        else:
            got = jax.jit(call)(x, send)
    else:
        got = call(x, send)
    unchanged(x, xs[jc.rank])
    if form == "learned":
        got, received = got
        np.testing.assert_array_equal(received, counts[jc.rank])
    np.testing.assert_array_equal(got, ys[jc.rank])


@pytest.mark.mpi
@pytest.mark.parametrize("seed", SEEDS)
@STARTED
def test_alltoallv_counts_computed_inside_jit(jc, graphs, seed, started):
    g, sources, destinations = graphs[seed]
    exchange = alltoallv_of(g, started)
    sendcounts = _counts(destinations, seed)
    xs = [rank_data(r, (12, 2), np.float32) for r in range(jc.size)]
    ys, counts = model_alltoallv(xs, sendcounts, sources, destinations, 12)

    @jax.jit
    def step(x, shifted):
        y, received = exchange(x, shifted - 1)
        return y, received

    y, received = step(xs[jc.rank], jnp.asarray(sendcounts[jc.rank]) + 1)
    np.testing.assert_array_equal(y, ys[jc.rank])
    np.testing.assert_array_equal(received, counts[jc.rank])


@pytest.mark.mpi
@pytest.mark.parametrize("name", sorted(GRIDS))
@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("width", WIDTHS)
def test_cartesian_halo_in_one_call(jc, grids, name, mode, width):
    grid = grids[name]
    dims, periods = GRIDS[name](jc.size)
    lists = grid_lists(dims, periods)
    assert grid.sources == grid.destinations == tuple(lists[grid.rank])
    blocks = [rank_data(r, (2 * len(dims), width), np.float32) + 1 for r in range(jc.size)]
    want = model_grid(blocks, dims, periods)[grid.rank]
    call = grid.neighbor_alltoall if mode == "eager" else jax.jit(grid.neighbor_alltoall)
    np.testing.assert_array_equal(call(blocks[grid.rank]), want)
    # allgather: the same with one block sent every way.
    x = rank_data(grid.rank, (width,), np.float32) + 1
    gathered = [
        np.stack([rank_data(r, (width,), np.float32) + 1] * 2 * len(dims)) for r in range(jc.size)
    ]
    call = grid.neighbor_allgather if mode == "eager" else jax.jit(grid.neighbor_allgather)
    np.testing.assert_array_equal(call(x), model_grid(gathered, dims, periods)[grid.rank])


@pytest.mark.mpi
@pytest.mark.parametrize("name", sorted(GRIDS))
@pytest.mark.parametrize("mode", ["eager", "jit"])
@STARTED
def test_cartesian_alltoallv(jc, grids, name, mode, started):
    # On a ring of 1 or 2 ranks both neighbours are one process: the blocks
    # of the two directions (of different sizes) must not swap.
    grid = grids[name]
    dims, periods = GRIDS[name](jc.size)
    lists = grid_lists(dims, periods)
    # Block k of rank r has (r + k) % 3 rows; off an edge nothing arrives.
    sendcounts = [
        np.array([(r + k) % 3 for k in range(2 * len(dims))], np.int32) for r in range(jc.size)
    ]
    xs = [rank_data(r, (8, 2), np.float32) for r in range(jc.size)]
    exchange = partial(alltoallv_of(grid, started), capacity=8)
    if mode == "jit":
        exchange = jax.jit(exchange)
    y, received = exchange(xs[grid.rank], sendcounts[grid.rank])
    want_counts = [
        0 if s == MPI.PROC_NULL else int(sendcounts[s][k ^ 1])
        for k, s in enumerate(lists[grid.rank])
    ]
    np.testing.assert_array_equal(received, want_counts)
    pieces = []
    for k, s in enumerate(lists[grid.rank]):
        if s != MPI.PROC_NULL:
            start = int(sendcounts[s][: k ^ 1].sum())
            pieces.append(xs[s][start : start + sendcounts[s][k ^ 1]])
    packed = np.concatenate([np.zeros((0, 2), np.float32), *pieces])
    want = np.zeros((8, 2), np.float32)
    want[: len(packed)] = packed
    np.testing.assert_array_equal(y, want)


# Transformations ------------------------------------------------------------------------


def _grad_model(weights, land, rank, shape):
    """d/dx of sum(w * neighbor_alltoall(x)) on ``rank``: the weight where each block landed."""
    out = np.zeros(shape)
    for j, (d, i) in enumerate(land[rank]):
        out[j] = weights[d][i]
    return out


@pytest.mark.x64
@pytest.mark.mpi
@pytest.mark.parametrize("seed", SEEDS)
def test_alltoall_jvp_grad_transpose_against_the_model(jc, graphs, seed):
    g, sources, destinations = graphs[seed]
    land = landing(sources, destinations)
    shape = (len(destinations[jc.rank]), 2)
    x = jnp.asarray(rank_data(jc.rank, shape, np.float64))
    t = [rank_data(r + 3, (len(destinations[r]), 2), np.float64) for r in range(jc.size)]
    y, dy = jax.jit(lambda x, t: jax.jvp(g.neighbor_alltoall, (x,), (t,)))(x, t[jc.rank])
    np.testing.assert_allclose(dy, model_alltoall(t, sources, destinations)[jc.rank])
    weights = [rank_data(r + 7, (len(sources[r]), 2), np.float64) for r in range(jc.size)]
    w = weights[jc.rank]
    grad = jax.jit(jax.grad(lambda x: jnp.sum(g.neighbor_alltoall(x) * w)))(x)
    np.testing.assert_allclose(grad, _grad_model(weights, land, jc.rank, shape))
    (ct,) = jax.linear_transpose(g.neighbor_alltoall, x)(jnp.asarray(w))
    np.testing.assert_allclose(ct, grad)
    # Reverse over reverse gives the exchange back.
    transpose = jax.linear_transpose(g.neighbor_alltoall, x)
    back = jax.linear_transpose(lambda c: transpose(c)[0], jnp.asarray(w))
    np.testing.assert_allclose(back(x)[0], g.neighbor_alltoall(x))


@pytest.mark.x64
@pytest.mark.mpi
@pytest.mark.parametrize("seed", SEEDS)
def test_allgather_grad_sums_what_comes_back(jc, graphs, seed):
    g, sources, destinations = graphs[seed]
    land = landing(sources, destinations)
    x = jnp.asarray(rank_data(jc.rank, (3,), np.float64))
    weights = [rank_data(r + 7, (len(sources[r]), 3), np.float64) for r in range(jc.size)]
    grad = jax.jit(jax.grad(lambda x: jnp.sum(g.neighbor_allgather(x) * weights[jc.rank])))(x)
    want = np.zeros(3)
    for d, i in land[jc.rank]:
        want += weights[d][i]
    np.testing.assert_allclose(grad, want)


@pytest.mark.x64
@pytest.mark.mpi
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("learn", [True, False])
@STARTED
def test_alltoallv_grad_is_the_reverse_exchange(jc, graphs, seed, learn, started):
    g, sources, destinations = graphs[seed]
    exchange = alltoallv_of(g, started)
    sendcounts = _counts(destinations, seed)
    rows, capacity = 10, 11
    xs = [rank_data(r, (rows, 2), np.float64) for r in range(jc.size)]
    _, counts = model_alltoallv(xs, sendcounts, sources, destinations, capacity)
    send = jnp.asarray(sendcounts[jc.rank])
    recv = None if learn else jnp.asarray(counts[jc.rank])
    weights = [rank_data(r + 7, (capacity, 2), np.float64) for r in range(jc.size)]

    def loss(x):
        y = exchange(x, send, recv, capacity=capacity)
        return jnp.sum(jnp.sin(y[0] if learn else y) * weights[jc.rank])

    x = jnp.asarray(xs[jc.rank]) * 0.3
    grad = jax.jit(jax.grad(loss))(x)
    # Finite differences of the summed loss along a direction.
    direction = rank_data(jc.rank + 1, x.shape, np.float64) - 2
    eps = 1e-6
    numeric = _total(jc, (loss(x + eps * direction) - loss(x - eps * direction)) / (2 * eps))
    analytic = _total(jc, np.sum(grad * direction))
    np.testing.assert_allclose(analytic, numeric, rtol=1e-6, atol=1e-8)
    # Rows past sum(sendcounts) are not sent: no gradient.
    np.testing.assert_array_equal(grad[int(sendcounts[jc.rank].sum()) :], 0)


@pytest.mark.x64
@pytest.mark.mpi
@pytest.mark.parametrize("name", sorted(GRIDS))
def test_cartesian_grad(jc, grids, name):
    grid = grids[name]
    dims, periods = GRIDS[name](jc.size)
    lists = grid_lists(dims, periods)
    n = 2 * len(dims)
    weights = [rank_data(r + 7, (n, 2), np.float64) for r in range(jc.size)]
    x = jnp.asarray(rank_data(grid.rank, (n, 2), np.float64))
    grad = jax.jit(jax.grad(lambda x: jnp.sum(grid.neighbor_alltoall(x) * weights[grid.rank])))(x)
    # Block k went to the neighbour lists[rank][k], which got it as block k ^ 1.
    want = np.zeros((n, 2))
    for k, d in enumerate(lists[grid.rank]):
        if d != MPI.PROC_NULL:
            want[k] = weights[d][k ^ 1]
    np.testing.assert_allclose(grad, want)


def _grid_exchange_model(sendcounts, lists):
    """Every rank's recvcounts of neighbor_alltoallv on a grid, and where each sent row landed.

    ``landed[r][k]`` is ``(d, row)``: block ``k`` of rank ``r`` starts at row
    ``row`` of rank ``d``'s result, or None where it went to ``MPI.PROC_NULL``.
    """
    recvcounts = [
        np.array([0 if s == MPI.PROC_NULL else sendcounts[s][k ^ 1] for k, s in enumerate(ranks)])
        for ranks in lists
    ]
    landed = [
        [
            None if d == MPI.PROC_NULL else (d, int(recvcounts[d][: k ^ 1].sum()))
            for k, d in enumerate(ranks)
        ]
        for ranks in lists
    ]
    return recvcounts, landed


@pytest.mark.x64
@pytest.mark.mpi
@pytest.mark.parametrize("name", sorted(GRIDS))
@pytest.mark.parametrize("learn", [True, False], ids=["learned", "recvcounts"])
@STARTED
def test_cartesian_alltoallv_cotangent_of_rows_sent_off_the_edge(jc, grids, name, learn, started):
    # Every rank sends rows every way, also off a non-periodic edge, where
    # they go nowhere: their cotangent is zero, on every path of reverse mode.
    grid = grids[name]
    dims, periods = GRIDS[name](jc.size)
    lists = grid_lists(dims, periods)
    n, rows, capacity = 2 * len(dims), 14, 13
    sendcounts = [np.array([(r + k) % 3 + 1 for k in range(n)], np.int32) for r in range(jc.size)]
    recvcounts, landed = _grid_exchange_model(sendcounts, lists)
    send = jnp.asarray(sendcounts[grid.rank])
    recv = None if learn else jnp.asarray(recvcounts[grid.rank], jnp.int32)
    exchange = alltoallv_of(grid, started)

    def f(x):
        y = exchange(x, send, recv, capacity=capacity)
        return y[0] if learn else y

    def want_of(weights):
        out = np.zeros((rows, 2))
        starts = np.concatenate([[0], np.cumsum(sendcounts[grid.rank])])
        for k, arrival in enumerate(landed[grid.rank]):
            if arrival is not None:
                d, at = arrival
                out[starts[k] : starts[k + 1]] = weights[d][at : at + starts[k + 1] - starts[k]]
        return out

    weights = [rank_data(r + 7, (capacity, 2), np.float64) + 1 for r in range(jc.size)]
    w = jnp.asarray(weights[grid.rank])
    x = jnp.asarray(rank_data(grid.rank, (rows, 2), np.float64))
    want = want_of(weights)
    batch = [[weights[r] * b for r in range(jc.size)] for b in (1, 2, 3)]

    # The gradient and the batch of cotangents under vmap in one compiled
    # program: one compile, not two.
    @jax.jit
    def jitted(x, cs):
        grad = jax.grad(lambda x: jnp.sum(f(x) * w))(x)
        return grad, jax.vmap(lambda c: jax.vjp(f, x)[1](c)[0])(cs)

    grad, got = jitted(x, jnp.asarray([b[grid.rank] for b in batch]))
    np.testing.assert_allclose(grad, want)
    _, pullback = jax.vjp(f, x)
    np.testing.assert_allclose(pullback(w)[0], want)
    aval = jax.ShapeDtypeStruct(x.shape, x.dtype)
    np.testing.assert_allclose(jax.linear_transpose(f, aval)(w)[0], want)
    # Under vmap, a batch of cotangents.
    for b, member in enumerate(batch):
        np.testing.assert_allclose(got[b], want_of(member))
    _still_matched(jc)


@pytest.mark.mpi
@pytest.mark.parametrize("seed", [0, 1])
def test_vmap_checkpoint_scan_while(jc, graphs, seed):
    g, sources, destinations = graphs[seed]
    blocks = [rank_data(r, (4, len(destinations[r]), 2), np.float32) for r in range(jc.size)]
    batch = jnp.asarray(blocks[jc.rank])
    got = jax.jit(jax.vmap(g.neighbor_alltoall))(batch)
    for b in range(4):
        want = model_alltoall([x[b] for x in blocks], sources, destinations)[jc.rank]
        np.testing.assert_array_equal(got[b], want)
    # vmap of the learned alltoallv, counts shared by the batch or batched.
    send = jnp.asarray(_counts(destinations, seed)[jc.rank])
    xs = jnp.asarray(rank_data(jc.rank, (4, 12, 2), np.float32))
    y, received = jax.vmap(lambda x: g.neighbor_alltoallv(x, send))(xs)
    y2, received2 = jax.vmap(lambda x, c: g.neighbor_alltoallv(x, c))(xs, jnp.stack([send] * 4))
    for b in range(4):
        yb, rb = g.neighbor_alltoallv(xs[b], send)
        np.testing.assert_array_equal(y[b], yb)
        np.testing.assert_array_equal(y2[b], yb)
        np.testing.assert_array_equal(received[b], rb)
        np.testing.assert_array_equal(received2[b], rb)

    # Three exchanges in a scan and in a while_loop, with checkpointed gradients.
    x = jnp.asarray(rank_data(jc.rank, (len(destinations[jc.rank]), 2), np.float32))

    def body(c, _):
        return c + jnp.sin(g.neighbor_allgather(c).sum(0)), None

    def scanned(v):
        c, _ = jax.lax.scan(jax.checkpoint(body), v.sum(0), None, length=3)
        return jnp.sum(c**2)

    def looped(v):
        c = v.sum(0)
        for _ in range(3):
            c, _ = body(c, None)
        return jnp.sum(c**2)

    np.testing.assert_allclose(jax.jit(jax.grad(scanned))(x), jax.grad(looped)(x), rtol=1e-5)
    c = jax.jit(
        lambda v: jax.lax.while_loop(
            lambda s: s[0] < 3, lambda s: (s[0] + 1, body(s[1], 0)[0]), (0, v)
        )[1]
    )(x.sum(0))
    np.testing.assert_allclose(c, jax.lax.scan(body, x.sum(0), None, length=3)[0], rtol=1e-6)


# Bad input ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ring(jc):
    r = JaxComm.from_graph([(jc.rank - 1) % jc.size], [(jc.rank + 1) % jc.size])
    yield r
    r.free()


@pytest.mark.mpi
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_wrong_arguments_raise_before_mpi(jc, graphs, ring, jit):
    # Wrong on every rank alike, so that every rank raises.
    g, _, destinations = graphs[0]
    x = jnp.ones((len(destinations[jc.rank]) + 1, 2))
    call = jax.jit(g.neighbor_alltoall) if jit else g.neighbor_alltoall
    match = rf"x has .* blocks on rank {jc.rank}; it needs one per destination"
    with pytest.raises(ValueError, match=match):
        call(x)
    with pytest.raises(ValueError, match="one entry per neighbour"):
        g.neighbor_alltoallv(x, [1] * (len(destinations[jc.rank]) + 1))
    with pytest.raises(ValueError, match=r"sendcounts\[0\]=-1 is negative"):
        ring.neighbor_alltoallv(x, [-1])
    with pytest.raises(ValueError, match="more than x's rows"):
        ring.neighbor_alltoallv(x, [x.shape[0] + 1])
    with pytest.raises(ValueError, match="more than the capacity"):
        ring.neighbor_alltoallv(x, [1], [3], capacity=2)
    with pytest.raises(TypeError, match="integer array"):
        ring.neighbor_alltoallv(x, [1.5])
    _still_matched(jc)


@pytest.mark.mpi
@pytest.mark.parametrize(
    "counts, reason",
    [
        ([-1], r"sendcounts\[0\] = -1 is negative"),
        ([5], "sendcounts add up to 5 rows, more than x's 4"),
    ],
)
@STARTED
def test_traced_counts_that_are_bad_fail_this_rank_and_its_destinations(
    jc, ring, counts, reason, started
):
    step = jax.jit(alltoallv_of(ring, started))
    op = "ineighbor_alltoallv" if started else "neighbor_alltoallv"
    # Only rank 0's counts are bad; rank 1 (its destination) fails naming it.
    mine = jnp.asarray(counts if jc.rank == 0 else [1], jnp.int32)
    if jc.rank == 0:
        match = rf"{op} on rank 0: {reason}; nothing was sent"
    elif jc.rank == 1 % jc.size:
        match = f"{op} on rank 1: the arguments of source 0 are invalid"
    if jc.rank in (0, 1 % jc.size):
        with pytest.raises(RUNTIME_ERRORS, match=match):
            jax.block_until_ready(step(jnp.ones((4, 2)), mine))
        not_reported_again()
    else:
        y, received = step(jnp.ones((4, 2)), mine)
        np.testing.assert_array_equal(received, [1])
    _still_matched(jc)


@pytest.mark.mpi
@STARTED
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_capacity_overflow_and_wrong_recvcounts_fail_the_receiver(jc, ring, started, jit):
    x = jnp.ones((4, 2))
    exchange = alltoallv_of(ring, started)
    maybe_jit = jax.jit if jit else (lambda f: f)
    with pytest.raises(
        RUNTIME_ERRORS, match="sources 0 to 0 send 3 rows, more than the capacity of 2"
    ):
        jax.block_until_ready(maybe_jit(lambda x, c: exchange(x, c, capacity=2))(x, jnp.array([3])))
    not_reported_again()
    with pytest.raises(RUNTIME_ERRORS, match=r"recvcounts\[0\] = 2, but source 0 sends 3 rows"):
        jax.block_until_ready(
            maybe_jit(lambda x, c, r: exchange(x, c, r, capacity=4))(
                x, jnp.array([3]), jnp.array([2])
            )
        )
    not_reported_again()
    with pytest.raises(
        RUNTIME_ERRORS, match=r"recvcounts add up to 5 rows, more than the capacity of 4"
    ):
        # Traced: static recvcounts this large are refused before any MPI call.
        jax.block_until_ready(
            jax.jit(lambda x, c, r: exchange(x, c, r, capacity=4))(
                x, jnp.array([3]), jnp.array([5])
            )
        )
    not_reported_again()
    # Nothing past the capacity was written: the next exchange is right.
    y = exchange(x * jc.rank, [2], [2], capacity=4)
    np.testing.assert_array_equal(
        y, np.concatenate([np.full((2, 2), (jc.rank - 1) % jc.size), np.zeros((2, 2))])
    )
    _still_matched(jc)


# Nonblocking ------------------------------------------------------------------------------


@pytest.mark.mpi
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_nonblocking_match_the_model(jc, graphs, seed, mode):
    g, sources, destinations = graphs[seed]
    blocks = [rank_data(r, (len(destinations[r]), 3), np.float32) for r in range(jc.size)]
    xs = [rank_data(r, (3,), np.float32) for r in range(jc.size)]
    gathered = [np.broadcast_to(xs[r], (len(destinations[r]), 3)) for r in range(jc.size)]

    def both(x, v):
        requests = [g.ineighbor_alltoall(x), g.ineighbor_allgather(v)]
        return g.waitall(requests)

    call = both if mode == "eager" else jax.jit(both)
    y, z = call(blocks[jc.rank], xs[jc.rank])
    np.testing.assert_array_equal(y, model_alltoall(blocks, sources, destinations)[jc.rank])
    np.testing.assert_array_equal(z, model_alltoall(gathered, sources, destinations)[jc.rank])


@pytest.mark.x64
@pytest.mark.mpi
@pytest.mark.parametrize("seed", SEEDS)
def test_nonblocking_grad_and_vmap(jc, graphs, seed):
    g, sources, destinations = graphs[seed]
    land = landing(sources, destinations)
    shape = (len(destinations[jc.rank]), 2)
    x = jnp.asarray(rank_data(jc.rank, shape, np.float64))
    weights = [rank_data(r + 7, (len(sources[r]), 2), np.float64) for r in range(jc.size)]
    w = weights[jc.rank]

    def loss(x):
        request = g.ineighbor_alltoall(x)
        return jnp.sum(g.wait(request) * w)

    grad = jax.jit(jax.grad(loss))(x)
    np.testing.assert_allclose(grad, _grad_model(weights, land, jc.rank, shape))
    v = jnp.asarray(rank_data(jc.rank, (2,), np.float64))
    gathered = jax.jit(jax.grad(lambda v: jnp.sum(g.wait(g.ineighbor_allgather(v)) * w)))(v)
    want = np.zeros(2)
    for d, i in land[jc.rank]:
        want += weights[d][i]
    np.testing.assert_allclose(gathered, want)
    batch = jnp.stack([x, 2 * x, 3 * x])
    got = jax.jit(jax.vmap(lambda x: g.wait(g.ineighbor_alltoall(x))))(batch)
    for b in range(3):
        np.testing.assert_allclose(got[b], g.neighbor_alltoall(batch[b]))


@pytest.mark.x64
@pytest.mark.mpi
@pytest.mark.parametrize("name", sorted(GRIDS))
def test_nonblocking_halo_and_its_grad_on_a_grid(jc, grids, name):
    grid = grids[name]
    dims, periods = GRIDS[name](jc.size)
    n = 2 * len(dims)
    blocks = [rank_data(r, (n, 2), np.float64) + 1 for r in range(jc.size)]
    x = jnp.asarray(blocks[grid.rank])
    np.testing.assert_array_equal(
        jax.jit(lambda x: grid.wait(grid.ineighbor_alltoall(x)))(x),
        model_grid(blocks, dims, periods)[grid.rank],
    )
    w = rank_data(grid.rank + 7, (n, 2), np.float64)
    blocking = jax.grad(lambda x: jnp.sum(grid.neighbor_alltoall(x) * w))(x)
    nonblocking = jax.jit(jax.grad(lambda x: jnp.sum(grid.wait(grid.ineighbor_alltoall(x)) * w)))(x)
    np.testing.assert_allclose(nonblocking, blocking)


@pytest.mark.x64
@pytest.mark.mpi
@pytest.mark.parametrize("seed", SEEDS)
def test_nonblocking_alltoallv_transformations_match_the_blocking_form(jc, graphs, seed):
    g, sources, destinations = graphs[seed]
    send = jnp.asarray(_counts(destinations, seed)[jc.rank])
    x = jnp.asarray(rank_data(jc.rank, (10, 2), np.float64))
    t = jnp.asarray(rank_data(jc.rank + 3, (10, 2), np.float64))

    def started(x):
        return g.wait(g.ineighbor_alltoallv(x, send, capacity=11))

    def blocking(x):
        return g.neighbor_alltoallv(x, send, capacity=11)

    ct = jnp.asarray(rank_data(jc.rank + 5, (11, 2), np.float64))
    first = lambda f: lambda x: f(x)[0]  # noqa: E731
    aval = jax.ShapeDtypeStruct(x.shape, x.dtype)
    batch = jnp.stack([x, 2 * x, 3 * x])

    # scan, fori_loop and cond, with checkpointed gradients.
    def body(c, _):
        return c + jnp.sin(started(c)[0][:10]), None

    def body_blocking(c, _):
        return c + jnp.sin(blocking(c)[0][:10]), None

    def scanned(step):
        return lambda v: jnp.sum(jax.lax.scan(jax.checkpoint(step), v, None, length=3)[0] ** 2)

    def branch(v, p):
        return jax.lax.cond(p, lambda v: started(v)[0], lambda v: v[:1] * 0 + jnp.zeros((11, 2)), v)

    # Every jitted form of the started exchange in one compiled program (the
    # cond both ways, the predicate known only at run time): one compile
    # where each took one.
    @jax.jit
    def jitted(x, t, ct, batch, p):
        return (
            jax.jvp(started, (x,), (t,)),
            jax.linear_transpose(first(started), aval)(ct),
            jax.vmap(lambda x: started(x)[0])(batch),
            jax.grad(scanned(body))(x),
            jax.lax.fori_loop(0, 3, lambda i, c: body(c, i)[0], x),
            branch(x, p),
            branch(x, jnp.logical_not(p)),
        )

    (
        ((y, received), (dy, _)),
        (got,),
        got_batch,
        grad,
        looped,
        taken,
        not_taken,
    ) = jitted(x, t, ct, batch, True)

    # jvp: the tangent is the same exchange of the tangent.
    np.testing.assert_array_equal(y, blocking(x)[0])
    np.testing.assert_array_equal(received, blocking(x)[1])
    np.testing.assert_array_equal(dy, blocking(t)[0])
    # linear_transpose: the reverse exchange, a request on the reverse graph.
    (want,) = jax.linear_transpose(first(blocking), aval)(ct)
    np.testing.assert_array_equal(got, want)

    # vmap with counts shared by the batch; counts per member are refused.
    for b in range(3):
        np.testing.assert_array_equal(got_batch[b], blocking(batch[b])[0])
    with pytest.raises(NotImplementedError, match="index arrays that differ between batch"):
        jax.vmap(lambda x, c: g.wait(g.ineighbor_alltoallv(x, c, capacity=11)))(
            batch, jnp.stack([send] * 3)
        )

    np.testing.assert_allclose(grad, jax.grad(scanned(body_blocking))(x), rtol=1e-12)
    np.testing.assert_allclose(looped, jax.lax.scan(body_blocking, x, None, length=3)[0])
    np.testing.assert_array_equal(taken, blocking(x)[0])
    np.testing.assert_array_equal(not_taken, np.zeros((11, 2)))
    _still_matched(jc)


# neighbor_allgatherv -----------------------------------------------------------------
#
# Each rank sends its first sendcount rows (a number of its own) to every
# destination; what arrives is packed in source order. The model takes each
# rank's landing list (``(d, i)``: its block arrives as block ``i`` on rank ``d``;
# None for MPI.PROC_NULL) and each rank's sources (MPI.PROC_NULL sends nothing).


def graph_land(sources, destinations):
    return landing(sources, destinations)


def grid_land(lists):
    """Block ``k`` of a grid's rank goes to ``lists[r][k]``, which gets it as block ``k ^ 1``."""
    return [[None if d == MPI.PROC_NULL else (d, k ^ 1) for k, d in enumerate(ds)] for ds in lists]


def model_allgatherv(xs, sendcount, sources, capacity):
    """Every rank's ``(y, recvcounts)`` of neighbor_allgatherv (NumPy)."""
    ys, counts = [], []
    for srcs in sources:
        got = [xs[s][: sendcount[s]] if s != MPI.PROC_NULL else xs[0][:0] for s in srcs]
        y = np.zeros((capacity, *xs[0].shape[1:]), xs[0].dtype)
        packed = np.concatenate([xs[0][:0], *got])
        y[: len(packed)] = packed
        ys.append(y)
        counts.append(np.array([len(g) for g in got], np.int32))
    return ys, counts


def model_allgatherv_grad(weights, counts, land, sendcount, rows, rank):
    """d/dx of sum(w * neighbor_allgatherv(x)) on ``rank``: what each destination weighs its rows by, summed."""
    grad = np.zeros((rows, *weights[0].shape[1:]))
    for edge in land[rank]:
        if edge is None:
            continue
        d, i = edge
        start = int(counts[d][:i].sum())
        grad[: sendcount[rank]] += weights[d][start : start + sendcount[rank]]
    return grad


def allgatherv_of(g, started):
    """``g.neighbor_allgatherv``, or ``ineighbor_allgatherv`` and its wait."""
    if not started:
        return g.neighbor_allgatherv
    return lambda *args, **kwargs: g.wait(g.ineighbor_allgatherv(*args, **kwargs))


def _gathered_rows(size, seed):
    """``(rows, sendcount)`` per rank: 0 to 3 rows, of which 0 to all are sent."""
    rng = np.random.default_rng(seed + 200)
    rows = rng.integers(0, 4, size)
    return rows, [int(rng.integers(0, r + 1)) for r in rows]


def _topology(jc, graphs, grids, where):
    """``(g, sources, land)`` of a random graph (``seed-N``) or a grid (``GRIDS`` name)."""
    if where.startswith("seed-"):
        g, sources, destinations = graphs[int(where[5:])]
        return g, sources, graph_land(sources, destinations)
    dims, periods = GRIDS[where](jc.size)
    lists = grid_lists(dims, periods)
    return grids[where], lists, grid_land(lists)


WHERE = [f"seed-{seed}" for seed in SEEDS] + sorted(GRIDS)


@pytest.mark.mpi
@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("form", ["learned", "recvcounts", "static"])
@pytest.mark.parametrize("mode", ["eager", "jit"])
@STARTED
def test_allgatherv_matches_the_model(jc, graphs, grids, where, form, mode, started):
    g, sources, _ = _topology(jc, graphs, grids, where)
    exchange = allgatherv_of(g, started)
    rows, sendcount = _gathered_rows(jc.size, len(where))
    xs = [rank_data(r, (rows[r], 2), np.float32) + 1 for r in range(jc.size)]
    capacity = 13
    ys, counts = model_allgatherv(xs, sendcount, sources, capacity)
    mine = counts[g.rank]

    def call(x):
        if form == "learned":
            return exchange(x, sendcount=sendcount[g.rank], capacity=capacity)
        if form == "recvcounts":
            return exchange(x, jnp.asarray(mine), sendcount=sendcount[g.rank], capacity=capacity)
        return exchange(x, mine.tolist(), sendcount=sendcount[g.rank], capacity=capacity)

    x = jnp.asarray(xs[g.rank])
    got = call(x) if mode == "eager" else jax.jit(call)(x)
    unchanged(x, xs[g.rank])
    if form == "learned":
        got, received = got
        np.testing.assert_array_equal(received, mine)
    np.testing.assert_array_equal(got, ys[g.rank])


@pytest.mark.mpi
@pytest.mark.parametrize("where", WHERE)
@STARTED
def test_allgatherv_counts_computed_inside_jit(jc, graphs, grids, where, started):
    g, sources, _ = _topology(jc, graphs, grids, where)
    exchange = allgatherv_of(g, started)
    sendcount = [r % 3 for r in range(jc.size)]
    xs = [rank_data(r, (3, 2), np.float32) + 1 for r in range(jc.size)]
    # The model's rows for every rank, cut to this rank's capacity (its
    # in-degree times x's rows; ranks' in-degrees differ).
    ys, counts = model_allgatherv(xs, sendcount, sources, 3 * max(map(len, sources)))
    ys = [y[: 3 * len(sources[g.rank])] for y in ys]

    @jax.jit
    def step(x, shifted, expected):
        # The default capacity: indegree times x's rows.
        y = exchange(x, expected - 1, sendcount=shifted - 1)
        learned, received = exchange(x, sendcount=shifted - 1)
        return y, learned, received

    y, learned, received = step(xs[g.rank], sendcount[g.rank] + 1, jnp.asarray(counts[g.rank]) + 1)
    np.testing.assert_array_equal(y, ys[g.rank])
    np.testing.assert_array_equal(learned, ys[g.rank])
    np.testing.assert_array_equal(received, counts[g.rank])


@pytest.mark.x64
@pytest.mark.mpi
@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("learn", [True, False])
@STARTED
def test_allgatherv_grad_sums_what_comes_back(jc, graphs, grids, where, learn, started):
    g, sources, land = _topology(jc, graphs, grids, where)
    exchange = allgatherv_of(g, started)
    rows, sendcount = _gathered_rows(jc.size, len(where) + 1)
    capacity = 12
    xs = [rank_data(r, (rows[r], 2), np.float64) + 1 for r in range(jc.size)]
    ys, counts = model_allgatherv(xs, sendcount, sources, capacity)
    weights = [rank_data(r + 7, (capacity, 2), np.float64) for r in range(jc.size)]
    recv = None if learn else jnp.asarray(counts[g.rank])
    k = jnp.asarray(sendcount[g.rank])

    def gathered(x):
        y = exchange(x, recv, sendcount=k, capacity=capacity)
        return y[0] if learn else y

    x = jnp.asarray(xs[g.rank])
    want = model_allgatherv_grad(weights, counts, land, sendcount, rows[g.rank], g.rank)
    t = [rank_data(r + 3, (rows[r], 2), np.float64) for r in range(jc.size)]

    # The gradient and the jvp in one compiled program: one compile, not two.
    @jax.jit
    def jitted(x, t):
        grad = jax.grad(lambda x: jnp.sum(gathered(x) * weights[g.rank]))(x)
        return grad, jax.jvp(gathered, (x,), (t,))

    grad, (y, dy) = jitted(x, jnp.asarray(t[g.rank]))
    np.testing.assert_allclose(grad, want)
    _, vjp = jax.vjp(gathered, x)
    np.testing.assert_allclose(vjp(jnp.asarray(weights[g.rank]))[0], want)
    (ct,) = jax.linear_transpose(gathered, x)(jnp.asarray(weights[g.rank]))
    np.testing.assert_allclose(ct, want)
    # jvp: the tangent is the same exchange of the tangent.
    np.testing.assert_allclose(y, ys[g.rank])
    np.testing.assert_allclose(dy, model_allgatherv(t, sendcount, sources, capacity)[0][g.rank])
    _still_matched(jc)


@pytest.mark.mpi
@pytest.mark.parametrize("where", ["seed-0", "seed-1", "line"])
@STARTED
def test_allgatherv_vmap_scan_fori_loop_cond(jc, graphs, grids, where, started):
    g, sources, _ = _topology(jc, graphs, grids, where)
    exchange = allgatherv_of(g, started)
    capacity = 2 * max(1, len(sources[g.rank]))
    xs = jnp.asarray(rank_data(g.rank, (3, 2, 2), np.float32))

    def one(x):
        return exchange(x, sendcount=1, capacity=capacity)[0]

    got = jax.jit(jax.vmap(one))(xs)
    for b in range(3):
        np.testing.assert_array_equal(got[b], one(xs[b]))
    # Counts given per batch member: one exchange each (blocking only).
    recv = jnp.asarray([0 if s == MPI.PROC_NULL else 1 for s in sources[g.rank]], jnp.int32)
    per_member = jax.vmap(lambda x, r: exchange(x, r, sendcount=1, capacity=capacity))
    if started:
        with pytest.raises(NotImplementedError, match="index arrays that differ between batch"):
            per_member(xs, jnp.stack([recv] * 3))
    else:
        got = per_member(xs, jnp.stack([recv] * 3))
        for b in range(3):
            np.testing.assert_array_equal(got[b], one(xs[b]))

    # A step that gathers its neighbours' first row and folds it in, in a
    # scan (with checkpointed gradients), a fori_loop and a cond.
    def body(c, _):
        y = exchange(c, sendcount=1, capacity=capacity)[0]
        return c + jnp.sin(y[:1]).sum(0), None

    def unrolled(v):
        for _ in range(3):
            v, _ = body(v, None)
        return v

    x = xs[0]
    scanned = jax.jit(lambda v: jax.lax.scan(jax.checkpoint(body), v, None, length=3)[0])
    branch = lambda v, p: jax.lax.cond(p, one, lambda v: jnp.zeros((capacity, 2), v.dtype), v)  # noqa: E731

    # The scan, its gradient (through the jitted scan, as a caller's jitted
    # step is differentiated), the fori_loop and both ways of the cond (the
    # predicate known only at run time) in one compiled program: one
    # compile where each took one.
    @jax.jit
    def program(v, p):
        looped = jax.lax.fori_loop(0, 3, lambda i, c: body(c, i)[0], v)
        grad = jax.grad(lambda v: jnp.sum(scanned(v) ** 2))(v)
        return scanned(v), looped, grad, branch(v, p), branch(v, jnp.logical_not(p))

    got_scanned, looped, grad, taken, not_taken = program(x, True)
    np.testing.assert_allclose(got_scanned, unrolled(x), rtol=1e-6)
    np.testing.assert_allclose(looped, unrolled(x), rtol=1e-6)
    np.testing.assert_allclose(grad, jax.grad(lambda v: jnp.sum(unrolled(v) ** 2))(x), rtol=1e-5)
    np.testing.assert_array_equal(taken, one(x))
    np.testing.assert_array_equal(not_taken, np.zeros((capacity, 2)))
    _still_matched(jc)


@pytest.mark.mpi
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", ["neighbor_allgatherv", "ineighbor_allgatherv"])
def test_allgatherv_wrong_arguments_raise_before_mpi(jc, graphs, ring, jit, name):
    # Wrong on every rank alike, so that every rank raises.
    g, sources, _ = graphs[0]
    call = getattr(g, name)
    x = jnp.ones((3, 2))
    maybe_jit = jax.jit if jit else (lambda f: f)
    with pytest.raises(ValueError, match="one entry per neighbour"):
        maybe_jit(lambda x: call(x, [1] * (len(sources[jc.rank]) + 1)))(x)
    with pytest.raises(ValueError, match=r"recvcounts\[0\]=-1 is negative"):
        maybe_jit(lambda x: getattr(ring, name)(x, [-1]))(x)
    with pytest.raises(ValueError, match="sendcount=-1 is negative"):
        maybe_jit(lambda x: getattr(ring, name)(x, sendcount=-1))(x)
    with pytest.raises(ValueError, match=r"sendcount=4 is more than x's rows \(3\)"):
        maybe_jit(lambda x: getattr(ring, name)(x, sendcount=4))(x)
    with pytest.raises(ValueError, match=r"more than the capacity \(2\)"):
        maybe_jit(lambda x: getattr(ring, name)(x, [3], capacity=2))(x)
    with pytest.raises(TypeError, match="integer array"):
        getattr(ring, name)(x, [1.5])
    with pytest.raises(TypeError, match="sendcount must be an integer"):
        getattr(ring, name)(x, sendcount=1.5)
    with pytest.raises(ValueError, match="sendcount must be one integer"):
        getattr(ring, name)(x, sendcount=jnp.array([1, 2]))
    _still_matched(jc)


@pytest.mark.mpi
@pytest.mark.parametrize(
    "count, reason",
    [(-1, "sendcount = -1 is negative"), (5, "sendcount = 5 is more than x's 4 rows")],
)
@pytest.mark.parametrize("name", ["neighbor_allgatherv", "ineighbor_allgatherv"])
def test_allgatherv_bad_traced_sendcount_fails_this_rank_and_its_destinations(
    jc, ring, count, reason, name
):
    step = jax.jit(lambda x, k: allgatherv_of(ring, name.startswith("i"))(x, sendcount=k))
    # Only rank 0's count is bad; rank 1 (its destination) fails naming it.
    mine = jnp.int32(count if jc.rank == 0 else 1)
    if jc.rank == 0:
        match = rf"{name} on rank 0: {reason}; nothing was sent"
    elif jc.rank == 1 % jc.size:
        match = f"{name} on rank 1: the arguments of source 0 are invalid"
    if jc.rank in (0, 1 % jc.size):
        with pytest.raises(RUNTIME_ERRORS, match=match):
            jax.block_until_ready(step(jnp.ones((4, 2)), mine))
        not_reported_again()
    else:
        y, received = step(jnp.ones((4, 2)), mine)
        np.testing.assert_array_equal(received, [1])
    _still_matched(jc)


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["neighbor_allgatherv", "ineighbor_allgatherv"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_allgatherv_counts_that_disagree_with_the_sender_fail_the_receiver(jc, ring, name, jit):
    x = jnp.ones((3, 2))
    exchange = allgatherv_of(ring, name.startswith("i"))
    maybe_jit = jax.jit if jit else (lambda f: f)
    with pytest.raises(RUNTIME_ERRORS, match=r"recvcounts\[0\] = 2, but source 0 sends 3 rows"):
        jax.block_until_ready(maybe_jit(lambda x, r: exchange(x, r, capacity=4))(x, jnp.array([2])))
    not_reported_again()
    with pytest.raises(
        RUNTIME_ERRORS, match="sources 0 to 0 send 3 rows, more than the capacity of 2"
    ):
        jax.block_until_ready(maybe_jit(lambda x: exchange(x, capacity=2))(x))
    not_reported_again()
    with pytest.raises(RUNTIME_ERRORS, match=r"recvcounts\[0\] = -1 is negative"):
        jax.block_until_ready(jax.jit(lambda x, r: exchange(x, r, capacity=4))(x, jnp.array([-1])))
    not_reported_again()
    # Nothing past the capacity was written: the next exchange is right.
    y = exchange(x * jc.rank, [3], capacity=4)
    want = np.concatenate([np.full((3, 2), (jc.rank - 1) % jc.size), np.zeros((1, 2))])
    np.testing.assert_array_equal(y, want)
    _still_matched(jc)


@pytest.mark.mpi(min_size=2)
def test_allgatherv_against_another_neighbour_call_is_a_checked_mismatch(jc, ring):
    jaxcomm.set_check(True)
    try:
        x = jnp.ones((2, 2))
        # Rank 0 gathers; the others make a neighbor_alltoallv of the same rows.
        call = jax.jit(
            (lambda x: ring.neighbor_allgatherv(x, [2]))
            if jc.rank == 0
            else (lambda x: ring.neighbor_alltoallv(x, [2], [2]))
        )
        with pytest.raises(RUNTIME_ERRORS, match="collective mismatch") as raised:
            jax.block_until_ready(call(x))
        assert "neighbor_allgatherv" in str(raised.value)
        assert "neighbor_alltoallv" in str(raised.value)
        not_reported_again()
    finally:
        jaxcomm.set_check(False)
    _still_matched(jc)
