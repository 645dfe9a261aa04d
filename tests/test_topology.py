"""Neighbourhood collectives on every topology MPI gives them, as peers' suites build them.

mpi4py's own tests run its neighbourhood collectives on a periodic Cartesian
grid, a ring made by ``MPI_Graph_create`` and a distributed graph, each on
``MPI.COMM_WORLD`` and on ``MPI.COMM_SELF``, and check the topology
properties of grids of 1 to 5 dimensions and of graphs made with weights.
The cases here cover the same ground for jaxcomm: grids periodic and not,
with dimensions of size 1 and 2 (where a rank is its own neighbour, or both
neighbours of a dimension are one rank) and with none at all; ``MPI_GRAPH``
graphs with self loops, duplicate edges and ranks without neighbours;
distributed graphs with weights, made adjacently or by
``MPI_Dist_graph_create``, with zero in- or out-degree. Every case is a
communicator wrapped by ``JaxComm(comm)``; its properties are compared with
mpi4py's, and every exchange (blocking and started, forward and reverse
mode) with a NumPy model built from every rank's neighbour lists.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI
from test_neighbor import grid_lists, landing

from jaxcomm import JaxComm

# The model ---------------------------------------------------------------------------


def grid_landing(lists):
    """``land[r][k]``: where block ``k`` of rank ``r`` of a grid arrives, ``(d, i)`` or None.

    A block sent towards -1 arrives in the receiver's block from +1 (MPI
    4.1, 8.6), also where both neighbours of a dimension are one rank;
    blocks sent to ``MPI.PROC_NULL`` arrive nowhere.
    """
    return [
        [None if d == MPI.PROC_NULL else (d, k ^ 1) for k, d in enumerate(ranks)] for ranks in lists
    ]


class Topology:
    """A topology communicator, its ``JaxComm``, and every rank's lists for the model."""

    def __init__(self, comm, sources, destinations, land):
        self.comm = comm
        self.jc = JaxComm(comm)
        self.sources = sources
        self.destinations = destinations
        self.land = land
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()

    def free(self):
        self.jc.free()
        self.comm.Free()

    def data(self, r, rows, *trailing):
        """Rank ``r``'s rows: every value names its rank and row."""
        return (1000.0 * (r + 1) + np.arange(rows * int(np.prod(trailing, dtype=int)))).reshape(
            rows, *trailing
        )

    def alltoall(self, blocks):
        out = [np.zeros((len(s), *blocks[0].shape[1:])) for s in self.sources]
        for r, row in enumerate(self.land):
            for j, arrival in enumerate(row):
                if arrival is not None:
                    d, i = arrival
                    out[d][i] = blocks[r][j]
        return out

    def alltoallv(self, xs, sendcounts, capacity):
        """Every rank's ``(y, recvcounts)``, and ``at[r][j]``: the row of its destination where block ``j`` starts."""
        pieces = [[np.zeros((0, *xs[0].shape[1:]))] * len(s) for s in self.sources]
        for r, row in enumerate(self.land):
            starts = np.concatenate([[0], np.cumsum(sendcounts[r])])
            for j, arrival in enumerate(row):
                if arrival is not None:
                    d, i = arrival
                    pieces[d][i] = xs[r][starts[j] : starts[j + 1]]
        recvcounts = [np.array([len(p) for p in got], np.int64) for got in pieces]
        ys = []
        for got in pieces:
            y = np.zeros((capacity, *xs[0].shape[1:]))
            packed = np.concatenate([np.zeros((0, *xs[0].shape[1:])), *got])
            y[: len(packed)] = packed
            ys.append(y)
        at = [
            [None if a is None else (a[0], int(recvcounts[a[0]][: a[1]].sum())) for a in row]
            for row in self.land
        ]
        return ys, recvcounts, at


def _on(base):
    return MPI.COMM_SELF if base == "self" else MPI.COMM_WORLD


def cartesian(ndim, periodic):
    """A grid of ``ndim`` dimensions (``MPI.Compute_dims``); ``periodic`` all, none or alternating."""

    def make(base):
        comm = _on(base)
        dims = MPI.Compute_dims(comm.Get_size(), [0] * ndim)
        periods = {
            "all": [True] * ndim,
            "none": [False] * ndim,
            "mixed": [d % 2 == 0 for d in range(ndim)],
        }[periodic]
        lists = grid_lists(dims, periods)
        return Topology(comm.Create_cart(dims, periods=periods), lists, lists, grid_landing(lists))

    return make


def empty_grid(base):
    # A grid of no dimensions is one process (MPI 4.1, 8.5.1): each rank alone.
    lists = [[]]
    return Topology(MPI.COMM_SELF.Create_cart([]), lists, lists, [[]])


def graph_comm(comm, lists):
    """``comm.Create_graph`` of every rank's neighbour ``lists``."""
    # The index with its leading 0, which mpi4py drops: without it an index
    # whose first node has no neighbours would read as one node fewer.
    index = np.cumsum([0] + [len(n) for n in lists]).tolist()
    return comm.Create_graph(index, [e for n in lists for e in n])


def graph_of(neighbors):
    """An ``MPI_Graph_create`` communicator of ``neighbors[r]`` per rank (a symmetric adjacency)."""

    def make(base):
        comm = _on(base)
        lists = neighbors(comm.Get_size())
        return Topology(graph_comm(comm, lists), lists, lists, landing(lists, lists))

    return make


def graph_ring(size):
    # mpi4py's: every rank lists the rank before it and the one after.
    return [[(r - 1) % size, (r + 1) % size] for r in range(size)]


def random_symmetric_graph(seed):
    """Undirected edges at random, self loops and repeats included; with 3 ranks or more the last has none."""

    def neighbors(size):
        rng = np.random.default_rng(seed)
        lonely = size - 1 if size >= 3 else None
        lists = [[] for _ in range(size)]
        for _ in range(int(rng.integers(size, 3 * size + 1))):
            a, b = (int(v) for v in rng.integers(0, size, 2))
            if lonely not in (a, b):
                lists[a].append(b)
                if a != b:
                    lists[b].append(a)
        return [[int(v) for v in rng.permutation(np.asarray(n, np.int64))] for n in lists]

    return neighbors


def dist_graph(edges, weighted, adjacent=True):
    """A distributed graph of ``edges(size)`` (``destinations`` per rank), with weights or not.

    Adjacent: every rank names its sources and destinations
    (``MPI_Dist_graph_create_adjacent``); otherwise each rank gives its own
    out-edges to ``MPI_Dist_graph_create``, and MPI orders the lists.
    """

    def make(base):
        comm = _on(base)
        size, rank = comm.Get_size(), comm.Get_rank()
        destinations = edges(size)
        sources = [[] for _ in range(size)]
        for r, targets in enumerate(destinations):
            for t in targets:
                sources[t].append(r)
        mine_in, mine_out = sources[rank], destinations[rank]
        if adjacent:
            if weighted:
                topo = comm.Create_dist_graph_adjacent(
                    mine_in,
                    mine_out,
                    [s + 1 for s in mine_in] if mine_in else MPI.WEIGHTS_EMPTY,
                    [d + 2 for d in mine_out] if mine_out else MPI.WEIGHTS_EMPTY,
                )
            else:
                topo = comm.Create_dist_graph_adjacent(mine_in, mine_out)
        else:
            weights = [d + 3 for d in mine_out] if weighted else MPI.UNWEIGHTED
            topo = comm.Create_dist_graph([rank], [len(mine_out)], mine_out, weights)
            # MPI chose each rank's order: the model takes it from every rank.
            sources, destinations = (
                [list(v) for v in lists]
                for lists in zip(*topo.allgather(topo.Get_dist_neighbors()[:2]))
            )
        return Topology(topo, sources, destinations, landing(sources, destinations))

    return make


TOPOLOGIES = {
    **{
        f"cart-{ndim}d-{periodic}": cartesian(ndim, periodic)
        for ndim, periodic in ((1, "all"), (1, "none"), (2, "all"), (2, "none"), (5, "all"))
    },
    # Compute_dims gives 3-d grids dimensions of size 1 (and 2 on 4 ranks).
    "cart-3d-mixed": cartesian(3, "mixed"),
    "cart-0d": empty_grid,
    "graph-ring": graph_of(graph_ring),
    **{f"graph-random-{seed}": graph_of(random_symmetric_graph(seed)) for seed in range(2)},
    # mpi4py's: from the two ranks before, to the two after.
    "distgraph-two-each-way": dist_graph(
        lambda size: [[(r + 1) % size, (r + 2) % size] for r in range(size)], weighted=False
    ),
    "distgraph-weighted": dist_graph(
        lambda size: [[(r + 1) % size, (r + 2) % size] for r in range(size)], weighted=True
    ),
    # mpi4py's Create_dist_graph case: to the rank before, itself and the rank after.
    "distgraph-created": dist_graph(
        lambda size: [[(r - 1) % size, r, (r + 1) % size] for r in range(size)],
        weighted=True,
        adjacent=False,
    ),
    # Rank 0 sends to every other rank and hears from none; the others only listen.
    "distgraph-star": dist_graph(
        lambda size: [list(range(1, size))] + [[] for _ in range(size - 1)], weighted=True
    ),
    "distgraph-empty": dist_graph(lambda size: [[] for _ in range(size)], weighted=True),
}
# On MPI.COMM_SELF, as mpi4py runs its own: each rank alone, its own neighbour.
ALONE = ("cart-1d-all", "cart-0d", "graph-ring", "distgraph-two-each-way")
CASES = [(name, "world") for name in TOPOLOGIES if name != "cart-0d"] + [
    (name, "self") for name in ALONE
]
CASE_IDS = [f"{name}-{base}" for name, base in CASES]


@pytest.fixture(scope="module")
def topologies():
    made = {}
    for name, base in CASES:
        made[name, base] = TOPOLOGIES[name](base)
    yield made
    for t in made.values():
        t.free()


def _still_matched(jc):
    np.testing.assert_array_equal(jc.allreduce(jnp.ones(2)), np.full(2, jc.size))


# Properties ---------------------------------------------------------------------------


@pytest.mark.mpi
@pytest.mark.parametrize("name, base", CASES, ids=CASE_IDS)
def test_properties_match_mpi4py(topologies, name, base):
    t = topologies[name, base]
    g, comm = t.jc, t.comm
    assert (g.rank, g.size) == (comm.Get_rank(), comm.Get_size())
    assert g.sources == tuple(t.sources[t.rank])
    assert g.destinations == tuple(t.destinations[t.rank])
    topology = comm.Get_topology()
    if topology == MPI.DIST_GRAPH:
        sources, destinations, _ = comm.Get_dist_neighbors()
        assert (g.sources, g.destinations) == (tuple(sources), tuple(destinations))
    if topology == MPI.GRAPH:
        assert g.sources == g.destinations == tuple(comm.Get_neighbors(t.rank))
    if topology != MPI.CART:
        for attribute in ("dims", "periods", "coords"):
            with pytest.raises(TypeError, match="no Cartesian topology"):
                getattr(g, attribute)
        return
    assert g.dims == tuple(comm.Get_topo()[0])
    assert g.periods == tuple(bool(p) for p in comm.Get_topo()[1])
    assert g.coords == tuple(comm.Get_coords(t.rank))
    shifts = []
    for direction in range(len(g.dims)):
        for disp in (1, -1, 2, 0):
            assert g.cart_shift(direction, disp) == comm.Shift(direction, disp)
        shifts.extend(comm.Shift(direction, 1))
    # The neighbours: per dimension, the one at -1 then the one at +1.
    assert g.sources == tuple(shifts)


# Results ------------------------------------------------------------------------------


@pytest.mark.mpi
@pytest.mark.parametrize("name, base", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("started", [False, True], ids=["blocking", "started"])
def test_exchanges_match_the_model(topologies, name, base, started):
    t = topologies[name, base]
    g, rank = t.jc, t.rank

    def run(op, *args, **kwargs):
        if started:
            return g.wait(getattr(g, "i" + op)(*args, **kwargs))
        return getattr(g, op)(*args, **kwargs)

    blocks = [t.data(r, len(t.destinations[r]), 3).astype(np.float32) for r in range(t.size)]
    want = t.alltoall(blocks)[rank]
    np.testing.assert_array_equal(run("neighbor_alltoall", blocks[rank]), want)
    np.testing.assert_array_equal(
        jax.jit(lambda x: run("neighbor_alltoall", x))(blocks[rank]), want
    )

    values = [t.data(r, 2).astype(np.float32) for r in range(t.size)]
    copies = [
        np.broadcast_to(values[r], (len(t.destinations[r]), *values[r].shape))
        for r in range(t.size)
    ]
    np.testing.assert_array_equal(
        jax.jit(lambda v: run("neighbor_allgather", v))(values[rank]), t.alltoall(copies)[rank]
    )

    capacity = 3 * max([len(s) for s in t.sources] + [1])
    sendcounts = [
        np.array([(r + j) % 4 for j in range(len(d))], np.int32)
        for r, d in enumerate(t.destinations)
    ]
    xs = [t.data(r, 3 * len(t.destinations[r]) + 1, 2).astype(np.float32) for r in range(t.size)]
    ys, recvcounts, _ = t.alltoallv(xs, sendcounts, capacity)
    y, received = jax.jit(lambda x, c: run("neighbor_alltoallv", x, c, capacity=capacity))(
        xs[rank], sendcounts[rank]
    )
    np.testing.assert_array_equal(y, ys[rank])
    np.testing.assert_array_equal(received, recvcounts[rank])
    y = run(
        "neighbor_alltoallv",
        xs[rank],
        sendcounts[rank].tolist(),
        recvcounts[rank].tolist(),
        capacity=capacity,
    )
    np.testing.assert_array_equal(y, ys[rank])
    _still_matched(g)


GRAPHS = [c for c in CASES if c[0].startswith(("graph-", "distgraph-created")) and c[1] == "world"]


@pytest.mark.mpi
@pytest.mark.parametrize("name, base", GRAPHS, ids=[f"{n}-{b}" for n, b in GRAPHS])
def test_large_blocks_take_mpi_s_collective_to_the_same_places(topologies, name, base):
    # Blocks past 64 KiB go to MPI_Neighbor_alltoall itself, whose order on
    # graphs with repeated edges the model must match too.
    t = topologies[name, base]
    blocks = [t.data(r, len(t.destinations[r]), 17000).astype(np.float32) for r in range(t.size)]
    np.testing.assert_array_equal(
        t.jc.neighbor_alltoall(blocks[t.rank]), t.alltoall(blocks)[t.rank]
    )


# Reverse mode -------------------------------------------------------------------------


@pytest.mark.x64
@pytest.mark.mpi
@pytest.mark.parametrize("name, base", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("started", [False, True], ids=["blocking", "started"])
def test_gradients_match_the_model(topologies, name, base, started):
    t = topologies[name, base]
    g, rank = t.jc, t.rank

    def run(op, *args, **kwargs):
        if started:
            return g.wait(getattr(g, "i" + op)(*args, **kwargs))
        return getattr(g, op)(*args, **kwargs)

    # neighbor_alltoall: each block's cotangent is the weight where it landed.
    weights = [t.data(r + 5, len(t.sources[r]), 2) for r in range(t.size)]
    x = jnp.asarray(t.data(rank, len(t.destinations[rank]), 2))
    grad = jax.jit(jax.grad(lambda x: jnp.sum(run("neighbor_alltoall", x) * weights[rank])))(x)
    want = np.zeros(x.shape)
    for j, arrival in enumerate(t.land[rank]):
        if arrival is not None:
            want[j] = weights[arrival[0]][arrival[1]]
    np.testing.assert_array_equal(grad, want)

    # neighbor_allgather: the sum of those weights.
    v = jnp.asarray(t.data(rank, 2))
    grad = jax.jit(jax.grad(lambda v: jnp.sum(run("neighbor_allgather", v) * weights[rank])))(v)
    np.testing.assert_array_equal(grad, want.sum(0))

    # neighbor_alltoallv, learned counts: the rows of each block get the
    # weights of the rows they landed on.
    capacity = 3 * max([len(s) for s in t.sources] + [1])
    sendcounts = [
        np.array([(r + j) % 4 for j in range(len(d))], np.int32)
        for r, d in enumerate(t.destinations)
    ]
    rows = 3 * len(t.destinations[rank]) + 1
    xs = [t.data(r, 3 * len(t.destinations[r]) + 1, 2) for r in range(t.size)]
    _, _, at = t.alltoallv(xs, sendcounts, capacity)
    row_weights = [t.data(r + 9, capacity, 2) for r in range(t.size)]
    send = jnp.asarray(sendcounts[rank])
    loss = lambda x: jnp.sum(  # noqa: E731
        run("neighbor_alltoallv", x, send, capacity=capacity)[0] * row_weights[rank]
    )
    grad = jax.jit(jax.grad(loss))(jnp.asarray(xs[rank]))
    want = np.zeros((rows, 2))
    starts = np.concatenate([[0], np.cumsum(sendcounts[rank])])
    for j, arrival in enumerate(at[rank]):
        if arrival is not None:
            d, row = arrival
            n = starts[j + 1] - starts[j]
            want[starts[j] : starts[j + 1]] = row_weights[d][row : row + n]
    np.testing.assert_array_equal(grad, want)
    _still_matched(g)


# MPI_GRAPH input MPI leaves undefined -------------------------------------------------


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(
    "lists, why",
    [
        # Rank 0 lists rank 1; rank 1 lists nobody.
        (lambda size: [[1]] + [[] for _ in range(size - 1)], "rank 0 lists rank 1 1 times"),
        # Rank 0 lists rank 1 twice, rank 1 lists rank 0 once.
        (
            lambda size: [[1, 1], [0]] + [[] for _ in range(size - 2)],
            "rank 0 lists rank 1 2 times among its neighbours, but rank 1 lists rank 0 1 times",
        ),
    ],
    ids=["one-way", "repeated-one-way"],
)
def test_an_asymmetric_graph_is_refused_on_every_rank(jc, lists, why):
    # MPI 4.1, 8.6: on an MPI_GRAPH, neighbourhood collectives need every
    # two ranks to list each other equally often. Every rank holds the whole
    # graph, so every rank refuses, before any message.
    neighbors = lists(jc.size)
    comm = graph_comm(MPI.COMM_WORLD, neighbors)
    g = JaxComm(comm)
    for call in (
        lambda: g.neighbor_alltoall(jnp.ones((len(neighbors[jc.rank]), 2))),
        lambda: g.neighbor_allgather(jnp.ones(2)),
        lambda: g.neighbor_alltoallv(jnp.ones((2, 2)), [0] * len(neighbors[jc.rank])),
        lambda: g.ineighbor_alltoall(jnp.ones((len(neighbors[jc.rank]), 2))),
    ):
        with pytest.raises(ValueError, match=f"only where every two ranks .*: {why}"):
            call()
    # The communicator still works for everything else.
    np.testing.assert_array_equal(g.allreduce(jnp.ones(2)), np.full(2, jc.size))
    g.free()
    comm.Free()
    _still_matched(jc)
