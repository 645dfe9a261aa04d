"""Exchanges whose counts are data: ragged_all_to_all and alltoallv with this rank's counts.

Every result is compared with a NumPy model of the exchange over random
patterns (``operations.ragged``: empty blocks, self-sends, a rank that sends
nothing), eagerly and jitted, with index arrays static or computed inside
``jit``; derivatives against the model (the op is linear) and finite
differences; transformations against loops; and bad input on one rank
against the errors ``docs/irregular.md`` promises, followed by a collective
that still matches on every rank.

Each test runs both forms (``FORMS``): the blocking call, and its
nonblocking start (``iragged_all_to_all``, ``ialltoallv``) completed by a
wait, which must give the same results and raise the same errors.
"""

import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import RUNTIME_ERRORS, not_reported_again, rank_data, unchanged
from operations import ragged, ragged_model

import jaxcomm
from jaxcomm._runtime import _kernels_cpu

EMULATED = os.environ.get("JAXCOMM_EMULATE_CUDA", "") not in ("", "0")
SEEDS = range(4)
TRAILING = [(), (3,)]


def _pattern(jc, seed, trailing=(), dtype=np.float32):
    """This rank's arguments of a random pattern, and every rank's, for the model."""
    rows, out_rows, args = ragged(jc.size, seed)
    operands = [rank_data(r, (rows, *trailing), dtype) for r in range(jc.size)]
    outputs = [rank_data(r + 10, (out_rows, *trailing), dtype) for r in range(jc.size)]
    return operands, outputs, args


def _int(args, dtype=np.int32):
    return [np.asarray(a, dtype) for a in args]


FORMS = ["blocking", "started"]


def _ragged(jc, form):
    """``ragged_all_to_all`` in ``form``: the method, or its start completed by a wait."""
    if form == "blocking":
        return jc.ragged_all_to_all
    return lambda *args, **kwargs: jc.wait(jc.iragged_all_to_all(*args, **kwargs))


def _alltoallv(jc, form):
    """``alltoallv`` by this rank's counts in ``form``."""
    if form == "blocking":
        return jc.alltoallv
    return lambda *args, **kwargs: jc.wait(jc.ialltoallv(*args, **kwargs))


def _total(jc, value):
    """The sum of a scalar over the ranks (mpi4py, outside jaxcomm's ordering)."""
    return jc.comm.allreduce(float(value))


# Results ------------------------------------------------------------------------------


@pytest.mark.mpi
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("trailing", TRAILING)
@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.complex64, np.bool_])
@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("form", FORMS)
def test_ragged_all_to_all_matches_the_model(jc, seed, trailing, dtype, mode, form):
    operands, outputs, args = _pattern(jc, seed, trailing, dtype)
    want = ragged_model(operands, outputs, args)[jc.rank]
    operand, output = jnp.asarray(operands[jc.rank]), jnp.asarray(outputs[jc.rank])
    call = _ragged(jc, form) if mode == "eager" else jax.jit(_ragged(jc, form))
    got = call(operand, output, *_int(args[jc.rank]))
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got), want)
    unchanged(operand, operands[jc.rank])
    unchanged(output, outputs[jc.rank])


@pytest.mark.x64
@pytest.mark.mpi
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("form", FORMS)
def test_index_arrays_computed_inside_jit(jc, seed, form):
    # The index arrays are int64 data read and transformed in the jitted
    # function, so the kernel sees values XLA computed.
    operands, outputs, args = _pattern(jc, seed, (2,), np.float64)
    want = ragged_model(operands, outputs, args)[jc.rank]

    @jax.jit
    def step(operand, output, packed):
        input_offsets, send_sizes, output_offsets, recv_sizes = (packed - 1)[:, ::-1]
        return _ragged(jc, form)(
            operand, output, input_offsets, send_sizes, output_offsets, recv_sizes
        )

    packed = np.stack(_int(args[jc.rank], np.int64))[:, ::-1] + 1
    got = step(operands[jc.rank], outputs[jc.rank], packed)
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.mpi(min_size=2)
def test_the_example_of_jax_lax_ragged_all_to_all(jc):
    if jc.size != 2:
        pytest.skip("the example is written for 2 ranks")
    args = [
        ([1, 2, 2], [0, 0, 0, 0], [0, 1], [1, 2], [0, 0], [1, 1]),
        ([3, 4, 0], [0, 0, 0, 0], [0, 1], [1, 1], [1, 2], [2, 1]),
    ][jc.rank]
    got = jc.ragged_all_to_all(*map(jnp.asarray, args))
    np.testing.assert_array_equal(got, [[1, 3, 0, 0], [2, 2, 4, 0]][jc.rank])


def _counts(size, seed):
    """Random alltoallv counts: ``matrix[i][j]`` rows from i to j, one rank sending nothing."""
    rng = np.random.default_rng([29, seed, size])
    matrix = rng.integers(0, 4, (size, size))
    matrix[rng.integers(size)] = 0
    return matrix


def _alltoallv_model(size, rank, matrix, data):
    return np.concatenate(
        [data(i)[matrix[i, :rank].sum() :][: matrix[i, rank]] for i in range(size)]
    )


@pytest.mark.mpi
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("form", FORMS)
def test_alltoallv_learns_the_counts(jc, seed, mode, form):
    size, rank = jc.size, jc.rank
    matrix = _counts(size, seed)
    rows = int(matrix.sum(axis=1).max()) + 1  # a padded input: the last rows are not sent
    capacity = int(matrix.sum(axis=0).max()) + 2
    data = lambda r: rank_data(r, (rows, 3), np.float32)  # noqa: E731
    want = _alltoallv_model(size, rank, matrix, data)
    x = jnp.asarray(data(rank))

    def call(x, counts):
        return _alltoallv(jc, form)(x, counts, capacity=capacity)

    for counts in (list(matrix[rank]), jnp.asarray(matrix[rank], jnp.int32)):
        y, received = (call if mode == "eager" else jax.jit(call))(x, counts)
        assert y.shape == (capacity, 3)
        np.testing.assert_array_equal(np.asarray(y[: len(want)]), want)
        np.testing.assert_array_equal(np.asarray(y[len(want) :]), 0)
        np.testing.assert_array_equal(np.asarray(received), matrix[:, rank])
        assert received.dtype == jnp.asarray(counts).dtype
    unchanged(x, data(rank))


@pytest.mark.mpi
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("form", FORMS)
def test_alltoallv_with_recvcounts(jc, seed, form):
    size, rank = jc.size, jc.rank
    matrix = _counts(size, seed)
    rows = int(matrix.sum(axis=1).max())
    data = lambda r: rank_data(r, (rows,), np.float32)  # noqa: E731
    want = _alltoallv_model(size, rank, matrix, data)
    x = jnp.asarray(data(rank))
    # Static counts: exactly the rows received (the static nonblocking form
    # takes exactly the rows sent).
    sent = x if form == "blocking" else x[: matrix[rank].sum()]
    y = _alltoallv(jc, form)(sent, list(matrix[rank]), list(matrix[:, rank]))
    np.testing.assert_array_equal(np.asarray(y), want)
    # Traced counts: a static capacity, zeros after the rows received.
    capacity = int(matrix.sum(axis=0).max())
    traced = jax.jit(lambda x, s, r: _alltoallv(jc, form)(x, s, r, capacity=capacity))
    y = traced(x, matrix[rank].astype(np.int32), matrix[:, rank].astype(np.int32))
    assert y.shape == (capacity,)
    np.testing.assert_array_equal(np.asarray(y[: len(want)]), want)
    np.testing.assert_array_equal(np.asarray(y[len(want) :]), 0)


@pytest.mark.mpi
@pytest.mark.parametrize("form", FORMS)
def test_alltoallv_rows_past_the_counts_stay_home(jc, form):
    x = jnp.arange(5.0) + 10 * jc.rank
    y, received = _alltoallv(jc, form)(x, [1] * jc.size, capacity=jc.size)
    np.testing.assert_array_equal(y, 10.0 * np.arange(jc.size) + jc.rank)
    np.testing.assert_array_equal(received, np.ones(jc.size))


# Transformations ------------------------------------------------------------------


def _ragged_fn(jc, args, form="blocking"):
    indices = [jnp.asarray(a, jnp.int32) for a in args[jc.rank]]
    return lambda operand, output: _ragged(jc, form)(operand, output, *indices)


@pytest.mark.x64
@pytest.mark.mpi
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("form", FORMS)
def test_ragged_jvp_and_transpose_against_the_model(jc, seed, form):
    operands, outputs, args = _pattern(jc, seed, (2,), np.float64)
    t_operands = [rank_data(r + 20, o.shape, np.float64) for r, o in enumerate(operands)]
    t_outputs = [rank_data(r + 30, o.shape, np.float64) for r, o in enumerate(outputs)]
    f = _ragged_fn(jc, args, form)
    primals = (operands[jc.rank], outputs[jc.rank])
    tangents = (t_operands[jc.rank] * 0.5, t_outputs[jc.rank] * 0.25)
    y, dy = jax.jit(lambda p, t: jax.jvp(f, p, t))(primals, tangents)
    np.testing.assert_allclose(y, ragged_model(operands, outputs, args)[jc.rank])
    model = ragged_model([o * 0.5 for o in t_operands], [o * 0.25 for o in t_outputs], args)
    np.testing.assert_allclose(dy, model[jc.rank])
    # <ct, F(t)> = <F^T(ct), t>, summed over the ranks.
    ct = rank_data(jc.rank + 3, y.shape, np.float64) - 2.0
    for transpose in (
        jax.linear_transpose(f, *primals),
        jax.jit(jax.linear_transpose(f, *primals)),
    ):
        ct_operand, ct_output = transpose(jnp.asarray(ct))
        left = _total(jc, np.sum(ct * model[jc.rank]))
        right = _total(jc, np.sum(ct_operand * tangents[0]) + np.sum(ct_output * tangents[1]))
        np.testing.assert_allclose(left, right, rtol=1e-12)


@pytest.mark.x64
@pytest.mark.mpi
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("form", FORMS)
def test_grad_against_finite_differences(jc, seed, form):
    operands, outputs, args = _pattern(jc, seed, (), np.float64)
    f = _ragged_fn(jc, args, form)
    weights = rank_data(jc.rank + 5, outputs[jc.rank].shape, np.float64)

    def loss(operand, output):
        return jnp.sum(jnp.sin(f(operand * operand, output)) * weights)

    primals = (jnp.asarray(operands[jc.rank]) * 0.3, jnp.asarray(outputs[jc.rank]) * 0.2)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(*primals)
    directions = (rank_data(jc.rank, primals[0].shape, np.float64) - 2, np.ones(primals[1].shape))
    eps = 1e-6
    plus = loss(*(p + eps * d for p, d in zip(primals, directions)))
    minus = loss(*(p - eps * d for p, d in zip(primals, directions)))
    numeric = _total(jc, (plus - minus) / (2 * eps))
    analytic = _total(jc, sum(np.sum(g * d) for g, d in zip(grads, directions)))
    np.testing.assert_allclose(analytic, numeric, rtol=1e-6, atol=1e-8)


@pytest.mark.x64
@pytest.mark.mpi
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("learn", [True, False])
@pytest.mark.parametrize("form", FORMS)
def test_alltoallv_grad_is_the_reverse_exchange(jc, seed, learn, form):
    size, rank = jc.size, jc.rank
    matrix = _counts(size, seed)
    rows = int(matrix.sum(axis=1).max()) + 1
    capacity = int(matrix.sum(axis=0).max()) + 1
    x = jnp.asarray(rank_data(rank, (rows, 2), np.float64))
    w = rank_data(rank + 7, (capacity, 2), np.float64)
    send = jnp.asarray(matrix[rank], jnp.int32)
    recv = None if learn else jnp.asarray(matrix[:, rank], jnp.int32)

    def loss(x):
        y = _alltoallv(jc, form)(x, send, recv, capacity=capacity)
        return jnp.sum((y[0] if learn else y) * w)

    grad = jax.jit(jax.grad(loss))(x)
    # Row i of x's block for rank j lands at row (rows from ranks before i) + i' on j.
    want = np.zeros((rows, 2))
    for j in range(size):
        start = matrix[:rank, j].sum()
        ws = rank_data(j + 7, (capacity, 2), np.float64)
        own = matrix[rank, :j].sum()
        want[own : own + matrix[rank, j]] = ws[start : start + matrix[rank, j]]
    np.testing.assert_allclose(grad, want)


@pytest.mark.mpi
@pytest.mark.parametrize("form", FORMS)
def test_vmap_shared_and_batched_index_arrays(jc, form):
    operands, outputs, args = _pattern(jc, 1, (2,))
    f = _ragged_fn(jc, args, form)
    xs = jnp.stack([jnp.asarray(operands[jc.rank]) * (b + 1) for b in range(3)])
    os = jnp.stack([jnp.asarray(outputs[jc.rank]) - b for b in range(3)])
    looped = jnp.stack([f(x, o) for x, o in zip(xs, os)])
    np.testing.assert_array_equal(jax.vmap(f)(xs, os), looped)
    np.testing.assert_array_equal(
        jax.jit(jax.vmap(f, in_axes=(1, 0)))(xs.swapaxes(0, 1), os), looped
    )
    # Only one side batched: the other is broadcast.
    np.testing.assert_array_equal(
        jax.jit(jax.vmap(f, in_axes=(None, 0)))(xs[0], os),
        jnp.stack([f(xs[0], o) for o in os]),
    )
    np.testing.assert_array_equal(
        jax.vmap(f, in_axes=(0, None))(xs, os[0]), jnp.stack([f(x, os[0]) for x in xs])
    )
    if form == "started":
        # One request moves one exchange: members with patterns of their own
        # are refused, before any MPI call, on every rank alike.
        batched = jnp.stack([jnp.asarray(args[jc.rank][0], jnp.int32)] * 2)
        with pytest.raises(NotImplementedError, match="index arrays that differ"):
            jax.vmap(lambda x, o, i: jc.wait(jc.iragged_all_to_all(x, o, i, *args[jc.rank][1:])))(
                xs[:2], os[:2], batched
            )
        _still_matched(jc)
        return
    # Each member its own pattern: one exchange per member.
    patterns = [ragged(jc.size, seed)[2][jc.rank] for seed in (5, 6)]
    rows = max(ragged(jc.size, seed)[0] for seed in (5, 6))
    out_rows = max(ragged(jc.size, seed)[1] for seed in (5, 6))
    indices = [jnp.stack([jnp.asarray(p[i], jnp.int32) for p in patterns]) for i in range(4)]
    x = jnp.asarray(rank_data(jc.rank, (2, rows), np.float32))
    o = jnp.zeros((2, out_rows), jnp.float32)
    got = jax.jit(jax.vmap(jc.ragged_all_to_all))(x, o, *indices)
    for b in range(2):
        one = jc.ragged_all_to_all(x[b], o[b], *(i[b] for i in indices))
        np.testing.assert_array_equal(got[b], one)


@pytest.mark.mpi
@pytest.mark.parametrize("form", FORMS)
def test_migration_in_fori_loop_and_cond(jc, form):
    """A new exchange pattern each step, counts computed in the loop; totals are conserved."""
    size, rank = jc.size, jc.rank
    capacity = 4 * size + 4

    def step(i, carry):
        x, n = carry  # the first n rows of x are this rank's particles
        live = jnp.arange(capacity) < n
        dest = jnp.where(live, (x.astype(jnp.int32) + i) % size, size)
        order = jnp.argsort(dest, stable=True)
        counts = jnp.sum(dest[None, :] == jnp.arange(size)[:, None], axis=1).astype(jnp.int32)
        y, received = _alltoallv(jc, form)(x[order], counts, capacity=capacity)
        kept = jax.lax.cond(i % 2 == 0, lambda y: y, lambda y: y * 1, y)
        return kept, jnp.sum(received).astype(jnp.int32)

    x = jnp.zeros(capacity).at[:3].set(jnp.arange(3.0) + rank)
    loop = jax.jit(lambda x: jax.lax.fori_loop(0, 5, step, (x, jnp.int32(3))))
    y, n = loop(x)
    assert _total(jc, n) == 3 * size
    assert _total(jc, jnp.sum(y)) == _total(jc, jnp.sum(x))

    @jax.jit
    def scanned(x):
        return jax.lax.scan(lambda c, i: (step(i, c), None), (x, jnp.int32(3)), jnp.arange(5))[0]

    y2, n2 = scanned(x)
    np.testing.assert_array_equal(y2, y)
    assert int(n2) == int(n)


@pytest.mark.mpi
@pytest.mark.parametrize("form", FORMS)
def test_large_count_path(jc, form):
    # Buffers past the (lowered) cap take MPI_Alltoallw on every rank.
    operands, outputs, args = _pattern(jc, 2, (3,))
    want = ragged_model(operands, outputs, args)[jc.rank]
    previous = _kernels_cpu.max_count()
    _kernels_cpu.set_max_count(5)
    try:
        got = _ragged(jc, form)(operands[jc.rank], outputs[jc.rank], *_int(args[jc.rank]))
    finally:
        _kernels_cpu.set_max_count(previous)
    np.testing.assert_array_equal(np.asarray(got), want)


def _work(a):
    return jax.lax.fori_loop(0, 8, lambda i, m: jnp.tanh(m @ m) * 0.5, a)


@pytest.mark.mpi
@pytest.mark.parametrize("op", ["iragged_all_to_all", "ialltoallv"])
def test_interior_runs_between_the_start_and_the_wait(jc, op):
    """The rows travel while the step computes: start, the interior's loop, then the wait."""
    operands, outputs, args = _pattern(jc, 3, (2,))
    matrix = _counts(jc.size, 3)
    a = jnp.full((32, 32), 0.01, jnp.float32)

    def program(operand, output, indices, a):
        if op == "iragged_all_to_all":
            request = jc.iragged_all_to_all(operand, output, *indices)
        else:
            request = jc.ialltoallv(operand, indices[0], indices[1], capacity=output.shape[0])
        interior = jc.during([request], _work, a)
        return jc.wait(request), interior

    if op == "iragged_all_to_all":
        indices = [jnp.asarray(i, jnp.int32) for i in args[jc.rank]]
        want = ragged_model(operands, outputs, args)[jc.rank]
        operand, output = operands[jc.rank], outputs[jc.rank]
    else:
        indices = [jnp.asarray(matrix[jc.rank], jnp.int32), jnp.asarray(matrix[:, jc.rank])]
        data = lambda r: rank_data(r, (int(matrix.sum(axis=1).max()), 2), np.float32)  # noqa: E731
        got = _alltoallv_model(jc.size, jc.rank, matrix, data)
        operand = data(jc.rank)
        output = np.zeros((int(matrix.sum(axis=0).max()) + 1, 2), np.float32)
        want = np.concatenate([got, output[len(got) :]])
    y, interior = jax.jit(program)(operand, output, indices, a)
    np.testing.assert_array_equal(np.asarray(y), want)
    np.testing.assert_allclose(interior, _work(a), rtol=1e-6)
    text = jax.jit(program).lower(operand, output, indices, a).compile().as_text()
    start = "iragged_all_to_all" if op == "iragged_all_to_all" else "ialltoallv_counts"
    order = [text.index(f'"jaxcomm_{start}"'), text.index(" while(")]
    order.append(text.index('"jaxcomm_wait_ragged"'))
    assert order == sorted(order), order


@pytest.mark.mpi
@pytest.mark.skipif(not EMULATED, reason="needs the CUDA kernels (JAXCOMM_EMULATE_CUDA=1)")
def test_gpu_staging_of_a_started_exchange_is_held_until_the_wait(jc):
    # On the staging path MPI moves the rows through pinned host copies of the
    # operand and the result (which starts as the output), held by the request
    # until its wait; fresh pinned memory holds a byte pattern, so rows the
    # exchange does not write show whether the output was loaded.
    kernels = jaxcomm._runtime.cuda_kernels
    operands, outputs, args = _pattern(jc, 2, (3,))
    want = ragged_model(operands, outputs, args)[jc.rank]
    saved = jaxcomm._gpu._override
    try:
        jaxcomm.set_cuda_aware(False)
        held = kernels.staging_held()
        request = jc.iragged_all_to_all(operands[jc.rank], outputs[jc.rank], *_int(args[jc.rank]))
        jax.block_until_ready(request._id)
        assert kernels.staging_held() == held + 2
        np.testing.assert_array_equal(np.asarray(jc.wait(request)), want)
        assert kernels.staging_held() == held
        jaxcomm.set_cuda_aware(True)
        request = jc.iragged_all_to_all(operands[jc.rank], outputs[jc.rank], *_int(args[jc.rank]))
        jax.block_until_ready(request._id)
        assert kernels.staging_held() == held
        np.testing.assert_array_equal(np.asarray(jc.wait(request)), want)
    finally:
        jaxcomm._gpu.apply_data_path(*(saved or (None, "")))


# Bad input -------------------------------------------------------------------------


def _still_matched(jc):
    np.testing.assert_array_equal(jc.allreduce(jnp.ones(2)), np.full(2, jc.size))


def _spoiled(jc, index, value):
    """The pattern of seed 0, with entry ``index`` = (array, peer) set to ``value`` on the last rank."""
    operands, outputs, args = _pattern(jc, 0)
    mine = [np.array(a, np.int32) for a in args[jc.rank]]
    if jc.rank == jc.size - 1:
        array, peer = index
        mine[array][peer] = value(mine, peer, operands[0].shape[0], outputs[0].shape[0])
    return operands[jc.rank], outputs[jc.rank], mine


LOCAL_ERRORS = {
    "negative offset": ((0, 0), lambda m, p, n, o: -1, r"input_offsets\[0\] = -1 is negative"),
    "negative size": ((1, 0), lambda m, p, n, o: -2, r"send_sizes\[0\] = -2 is negative"),
    "overruns operand": ((1, 0), lambda m, p, n, o: n + 1, "overruns the operand's"),
    "overruns output": ((2, 0), lambda m, p, n, o: o + 1, "overruns the peer's output"),
    "negative recv": ((3, 0), lambda m, p, n, o: -1, r"recv_sizes\[0\] = -1 is negative"),
}


@pytest.mark.mpi
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", sorted(LOCAL_ERRORS))
@pytest.mark.parametrize("form", FORMS)
def test_one_ranks_bad_arguments_fail_every_rank_before_anything_moves(jc, case, jit, form):
    index, value, reason = LOCAL_ERRORS[case]
    operand, output, mine = _spoiled(jc, index, value)
    last = jc.size - 1
    call = jax.jit(_ragged(jc, form)) if jit else _ragged(jc, form)
    if jc.rank == last:
        match = rf"ragged_all_to_all on rank {last}: .*{reason}.*nothing was exchanged"
    else:
        match = rf"ragged_all_to_all on rank {jc.rank}: rank {last}'s arguments are invalid"
    with pytest.raises(RUNTIME_ERRORS, match=match):
        jax.block_until_ready(call(operand, output, *mine))
    not_reported_again()
    _still_matched(jc)


@pytest.mark.mpi
@pytest.mark.parametrize("form", FORMS)
def test_recv_sizes_that_disagree_fail_both_ends_only(jc, form):
    operands, outputs, args = _pattern(jc, 0)
    mine = [np.array(a, np.int32) for a in args[jc.rank]]
    last = jc.size - 1
    if jc.rank == 0:
        mine[3][last] += 1
    if jc.rank in (0, last):
        match = "recv_sizes" if jc.rank == 0 else "expects"
        with pytest.raises(
            RUNTIME_ERRORS, match=rf"ragged_all_to_all on rank {jc.rank}: .*{match}"
        ):
            jax.block_until_ready(_ragged(jc, form)(operands[jc.rank], outputs[jc.rank], *mine))
        not_reported_again()
    else:
        got = _ragged(jc, form)(operands[jc.rank], outputs[jc.rank], *mine)
        np.testing.assert_array_equal(got, ragged_model(operands, outputs, args)[jc.rank])
    _still_matched(jc)


@pytest.mark.mpi
@pytest.mark.parametrize("form", FORMS)
def test_overlapping_received_slices_fail_the_receiver(jc, form):
    # Every rank writes its slice for rank 0 at row 0 of rank 0's result.
    x = jnp.ones((1, 2)) * jc.rank
    sizes = np.zeros(jc.size, np.int32)
    sizes[0] = 1
    recv = np.full(jc.size, 1 if jc.rank == 0 else 0, np.int32)
    zeros = np.zeros(jc.size, np.int32)
    call = lambda: _ragged(jc, form)(x, jnp.zeros((1, 2)), zeros, sizes, zeros, recv)  # noqa: E731
    if jc.rank == 0 and jc.size > 1:
        with pytest.raises(RUNTIME_ERRORS, match="rank 0: the received blocks of peers 0 and 1"):
            jax.block_until_ready(call())
        not_reported_again()
    else:
        np.testing.assert_array_equal(call(), np.zeros((1, 2)) if jc.rank else x)
    _still_matched(jc)


@pytest.mark.mpi
@pytest.mark.parametrize("form", FORMS)
def test_capacity_overflow_fails_the_receiver_only(jc, form):
    # Every rank sends one row to rank 0, whose capacity holds size - 1.
    counts = jnp.asarray([1] + [0] * (jc.size - 1), jnp.int32)
    step = jax.jit(lambda x, c: _alltoallv(jc, form)(x, c, capacity=jc.size - 1))
    if jc.rank == 0:
        with pytest.raises(RUNTIME_ERRORS, match="alltoallv on rank 0: ranks 0 to .* capacity of"):
            jax.block_until_ready(step(jnp.ones(2), counts))
        not_reported_again()
    else:
        y, received = step(jnp.ones(2), counts)
        np.testing.assert_array_equal(received, 0)
    _still_matched(jc)


@pytest.mark.mpi
@pytest.mark.parametrize("form", FORMS)
def test_traced_counts_that_overrun_x_fail_every_rank(jc, form):
    counts = np.zeros(jc.size, np.int32)
    if jc.rank == 0:
        counts[-1] = 3
    step = jax.jit(lambda x, c: _alltoallv(jc, form)(x, c))
    with pytest.raises(RUNTIME_ERRORS, match=rf"alltoallv on rank {jc.rank}: "):
        jax.block_until_ready(step(jnp.ones(2), counts))
    not_reported_again()
    _still_matched(jc)


@pytest.mark.mpi
@pytest.mark.parametrize("form", FORMS)
def test_transpose_of_overlapping_sends_is_refused(jc, form):
    # Rank r sends its one row to every rank: the transpose would have to add.
    x = jnp.ones((1, 2))
    ones = np.ones(jc.size, np.int32)
    zeros = np.zeros(jc.size, np.int32)
    f = lambda x: _ragged(jc, form)(  # noqa: E731
        x, jnp.zeros((jc.size, 2)), zeros, ones, np.full(jc.size, jc.rank, np.int32), ones
    )
    np.testing.assert_array_equal(f(x), np.ones((jc.size, 2)))
    if jc.size == 1:
        return
    with pytest.raises(RUNTIME_ERRORS, match="sends a row more than once is not supported"):
        jax.block_until_ready(jax.grad(lambda x: jnp.sum(f(x)))(x))
    not_reported_again()
    _still_matched(jc)


def test_python_checks():
    from mpi4py import MPI

    from jaxcomm import JaxComm

    jc = JaxComm(MPI.COMM_SELF)
    try:
        one = np.zeros(1, np.int32)
        with pytest.raises(ValueError, match=r"input_offsets has shape \(2,\)"):
            jc.ragged_all_to_all(jnp.ones(2), jnp.ones(2), np.zeros(2, np.int32), one, one, one)
        with pytest.raises(TypeError, match="send_sizes must be an integer array"):
            jc.ragged_all_to_all(jnp.ones(2), jnp.ones(2), one, np.zeros(1), one, one)
        with pytest.raises(ValueError, match="operand rows have shape"):
            jc.ragged_all_to_all(jnp.ones((2, 2)), jnp.ones(2), one, one, one, one)
        with pytest.raises(TypeError, match="operand is float32, output int32"):
            jc.ragged_all_to_all(
                jnp.ones(2, jnp.float32), jnp.ones(2, jnp.int32), one, one, one, one
            )
        with pytest.raises(ValueError, match="sendcounts add up to 3 rows, more than x's rows"):
            jc.alltoallv(jnp.ones(2), [3])
        with pytest.raises(ValueError, match=r"sendcounts\[0\]=-1 is negative"):
            jc.alltoallv(jnp.ones(2), [-1])
        with pytest.raises(ValueError, match="recvcounts add up to 2 rows, more than the capacity"):
            jc.alltoallv(jnp.ones(2), [1], [2], capacity=1)
    finally:
        jc.free()


# What JAX's own tests of jax.lax.ragged_all_to_all check, on MPI ranks -------------
#
# JAX tests its collective on a mesh axis (tests/ragged_collective_test.py):
# its docstring's example forward, with axis_index_groups (groups of two, and
# groups of one), first derivatives by finite differences, vmap with the batch
# on either axis of the data and of the index arrays, and errors for index
# arrays that are not 1-D integer arrays. The same behaviour here, with the
# communicator (split into groups) in place of the axis.

# JAX's example, one entry per rank of a pair: operand, input_offsets,
# send_sizes, output_offsets, recv_sizes, and the result on a zero output of 4 rows.
PAIR = (
    ([1, 2, 2], [0, 1], [1, 2], [0, 0], [1, 1], [1, 3, 0, 0]),
    ([3, 4, 0], [0, 1], [1, 1], [1, 2], [2, 1], [2, 2, 4, 0]),
)
# A rank alone: one block to itself, written away from the output's start.
ALONE = (
    ([1, 0, 0, 0], [0], [1], [2], [1], [0, 0, 1, 0]),
    ([2, 3, 4, 0], [0], [3], [1], [3], [0, 2, 3, 4]),
)


def _group_case(jc, group, dtype):
    """This rank's arguments in ``group`` and its result: JAX's example in a pair, else alone.

    The second pair's data is ten times the first's (as in JAX's test of
    groups); ranks alone take the two cases of JAX's test of groups of one in turn.
    """
    if group.size == 2:
        operand, *indices, want = PAIR[group.rank]
        factor = 10 ** (jc.rank // 2 % 2)
    else:
        operand, *indices, want = ALONE[jc.rank % 2]
        factor = 1
    indices = [np.asarray(i, np.int32) for i in indices]
    operand = np.asarray(operand, dtype) * factor
    return operand, np.zeros(4, dtype), indices, np.asarray(want, dtype) * factor


def _groups(jc, grouping):
    """``jc`` split into pairs (a rank left over alone) or into ranks alone."""
    return jc.split(color=jc.rank // 2 if grouping == "pairs" else jc.rank, key=jc.rank)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [np.int32, np.float32])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("grouping", ["pairs", "alone"])
def test_jax_example_in_groups(jc, grouping, form, jit, dtype):
    # JAX's axis_index_groups ((0, 1), (2, 3)) and ((0,), (1,)): here each
    # group is a communicator of its own.
    group = _groups(jc, grouping)
    try:
        operand, output, indices, want = _group_case(jc, group, dtype)
        call = jax.jit(_ragged(group, form)) if jit else _ragged(group, form)
        got = call(operand, output, *indices)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), want)
        unchanged(output, np.zeros(4))
    finally:
        group.free()


@pytest.mark.x64
@pytest.mark.mpi
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("grouping", ["pairs", "alone"])
def test_jax_example_first_derivatives(jc, grouping, form):
    # JAX checks them by finite differences in both modes. Forward mode is
    # checked on each rank (every rank moves its primals together); reverse
    # mode by <ct, J t> = <J^T ct, t> summed over the ranks, since a rank's
    # J^T ct holds what its peers' cotangents sent back.
    from jax.test_util import check_grads

    group = _groups(jc, grouping)
    try:
        operand, output, indices, _ = _group_case(jc, group, np.float64)
        f = lambda operand, output: _ragged(group, form)(operand, output, *indices)  # noqa: E731
        primals = (operand + 0.5, output + 0.25)
        check_grads(f, primals, order=1, modes=["fwd"])
        tangents = (rank_data(jc.rank, operand.shape, np.float64), np.ones(4))
        y, f_t = jax.jvp(f, primals, tangents)
        ct = rank_data(jc.rank + 1, y.shape, np.float64) - 1.5
        back = jax.vjp(f, *primals)[1](jnp.asarray(ct))
        left = _total(jc, np.sum(ct * np.asarray(f_t)))
        right = _total(jc, sum(np.sum(np.asarray(b) * t) for b, t in zip(back, tangents)))
        np.testing.assert_allclose(left, right, rtol=1e-12)
    finally:
        group.free()


@pytest.mark.mpi
@pytest.mark.parametrize("index_axis", [None, 0, 1])
@pytest.mark.parametrize("data_axis", [0, 1])
@pytest.mark.parametrize("form", FORMS)
def test_vmap_with_the_batch_on_either_axis(jc, form, data_axis, index_axis):
    # Two members with rows of 3 columns, the batch axis first or second in
    # the data and in the index arrays (or the index arrays shared): the same
    # as a loop over the members.
    seeds = (5, 5) if index_axis is None else (5, 6)
    patterns = [ragged(jc.size, seed) for seed in seeds]
    rows = max(p[0] for p in patterns)
    out_rows = max(p[1] for p in patterns)
    indices = [[jnp.asarray(p[2][jc.rank][i], jnp.int32) for p in patterns] for i in range(4)]
    operands = [jnp.asarray(rank_data(jc.rank + b, (rows, 3), np.float32)) for b in (0, 1)]
    outputs = [jnp.asarray(rank_data(jc.rank + 9 + b, (out_rows, 3), np.float32)) for b in (0, 1)]
    looped = jnp.stack(
        [_ragged(jc, form)(operands[b], outputs[b], *(i[b] for i in indices)) for b in (0, 1)]
    )
    batched = [jnp.stack(a, axis=data_axis) for a in (operands, outputs)]
    if index_axis is None:
        batched += [i[0] for i in indices]
    else:
        batched += [jnp.stack(i, axis=index_axis) for i in indices]
    in_axes = (data_axis, data_axis, *[index_axis] * 4)
    mapped = jax.jit(jax.vmap(_ragged(jc, form), in_axes=in_axes))
    if form == "started" and index_axis is not None:
        # One request moves one exchange: refused on every rank alike.
        with pytest.raises(NotImplementedError, match="index arrays that differ"):
            mapped(*batched)
        _still_matched(jc)
        return
    np.testing.assert_array_equal(mapped(*batched), looped)


@pytest.mark.mpi
@pytest.mark.parametrize("form", FORMS)
def test_axis_index_groups_are_refused_on_every_rank(jc, form):
    operands, outputs, args = _pattern(jc, 0)
    mine = _int(args[jc.rank])

    def call(operand, output, *indices):
        return _ragged(jc, form)(operand, output, *indices, axis_index_groups=[[0]])

    with pytest.raises(NotImplementedError, match="axis_index_groups is not supported"):
        call(operands[jc.rank], outputs[jc.rank], *mine)
    with pytest.raises(NotImplementedError, match="axis_index_groups is not supported"):
        jax.jit(call)(operands[jc.rank], outputs[jc.rank], *mine)
    with pytest.raises(NotImplementedError, match="axis_index_groups is not supported"):
        batched = (np.stack([operands[jc.rank]] * 2), np.stack([outputs[jc.rank]] * 2))
        jax.vmap(call, in_axes=(0, 0, None, None, None, None))(*batched, *mine)
    _still_matched(jc)


NAMES = ["input_offsets", "send_sizes", "output_offsets", "recv_sizes"]
BAD_INDEX_ARRAYS = {
    "float": (lambda a: a.astype(np.float32), TypeError, "must be an integer array"),
    "2-d": (lambda a: a[None, :], ValueError, r"has shape \(1, "),
    "empty": (lambda a: a[:0], ValueError, r"has shape \(0,\)"),
}


@pytest.mark.mpi
@pytest.mark.parametrize("case", sorted(BAD_INDEX_ARRAYS))
@pytest.mark.parametrize("which", NAMES)
@pytest.mark.parametrize("form", FORMS)
def test_index_arrays_of_the_wrong_kind_fail_every_rank(jc, form, which, case):
    # Raised while tracing, on every rank alike, before any MPI call.
    spoil, error, reason = BAD_INDEX_ARRAYS[case]
    operands, outputs, args = _pattern(jc, 0)
    mine = _int(args[jc.rank])
    mine[NAMES.index(which)] = spoil(mine[NAMES.index(which)])
    for call in (_ragged(jc, form), jax.jit(_ragged(jc, form))):
        with pytest.raises(error, match=f"{which} {reason}"):
            call(operands[jc.rank], outputs[jc.rank], *mine)
    _still_matched(jc)


@pytest.mark.mpi
@pytest.mark.parametrize(
    "dtype", ["float64", "int64", "float16", "bfloat16", "uint8", "complex128"]
)
@pytest.mark.parametrize("form", FORMS)
def test_more_row_shapes_and_dtypes(jc, form, dtype):
    # Rows of two trailing dimensions, in the dtypes the model test above leaves out.
    dtype = jnp.dtype(dtype)
    operands, outputs, args = _pattern(jc, 1, (2, 3), dtype)
    want = ragged_model(operands, outputs, args)[jc.rank]
    got = jax.jit(_ragged(jc, form))(operands[jc.rank], outputs[jc.rank], *_int(args[jc.rank]))
    assert got.dtype == dtype and got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.mpi
@pytest.mark.parametrize("form", FORMS)
def test_blocks_in_any_order_and_empty_ones_anywhere(jc, form):
    # Each rank reads its blocks from the end of the operand backwards and
    # writes them in reverse rank order on the receiver; every block for an
    # even-numbered receiver from an odd-numbered sender is empty, with its
    # offsets at the buffers' very ends.
    size, rank = jc.size, jc.rank
    sizes = np.array(
        [[0 if s % 2 and r % 2 == 0 else 1 + (s + r) % 2 for r in range(size)] for s in range(size)]
    )
    rows = int(sizes.sum(axis=1).max())
    out_rows = int(sizes.sum(axis=0).max())
    args = []
    for s in range(size):
        ends = rows - np.cumsum(sizes[s])
        input_offsets = np.where(sizes[s] > 0, ends, rows)
        output_offsets = [
            int(sizes[s + 1 :, r].sum()) if sizes[s, r] else out_rows for r in range(size)
        ]
        args.append((input_offsets, sizes[s], np.asarray(output_offsets), sizes[:, s].copy()))
    operands = [rank_data(r, (rows, 2), np.float32) for r in range(size)]
    outputs = [rank_data(r + 4, (out_rows, 2), np.float32) for r in range(size)]
    want = ragged_model(operands, outputs, args)[rank]
    for call in (_ragged(jc, form), jax.jit(_ragged(jc, form))):
        got = call(operands[rank], outputs[rank], *_int(args[rank]))
        np.testing.assert_array_equal(np.asarray(got), want)


# axis_name, as jax.lax.ragged_all_to_all takes it ------------------------------------


def _exchange_written_for_jax(exchange, operand, output, indices, axis_name):
    """A step written against ``jax.lax.ragged_all_to_all``'s signature, the exchange an argument."""
    input_offsets, send_sizes, output_offsets, recv_sizes = indices
    y = exchange(
        operand * 2,
        output,
        input_offsets,
        send_sizes,
        output_offsets,
        recv_sizes,
        axis_name=axis_name,
    )
    return jnp.tanh(y)


@pytest.mark.mpi
@pytest.mark.parametrize("form", FORMS)
def test_axis_name_needs_a_for_mesh_communicator(jc, form):
    # A JaxComm not made by for_mesh spans no mesh axis: only None names its
    # ranks, and the refusal comes on every rank, while tracing.
    operands, outputs, args = _pattern(jc, 0)
    mine = _int(args[jc.rank])
    want = ragged_model(operands, outputs, args)[jc.rank]
    call = _ragged(jc, form)
    got = call(operands[jc.rank], outputs[jc.rank], *mine, axis_name=None)
    np.testing.assert_array_equal(np.asarray(got), want)
    for run in (call, jax.jit(call, static_argnames="axis_name")):
        with pytest.raises(ValueError, match="was not made by JaxComm.for_mesh"):
            run(operands[jc.rank], outputs[jc.rank], *mine, axis_name="x")
        with pytest.raises(TypeError, match="axis_name must be a mesh axis name"):
            run(operands[jc.rank], outputs[jc.rank], *mine, axis_name=3)
    _still_matched(jc)


@pytest.mark.mpi
@pytest.mark.parametrize("form", FORMS)
def test_a_drop_in_for_jax_lax_ragged_all_to_all_on_one_process(jc, form):
    # for_mesh needs one device of each process: without jax.distributed,
    # one process. tests/test_shard_map.py runs the same on 2 and 4 processes.
    if jc.size != 1:
        pytest.skip("for_mesh on several processes needs jax.distributed (test_shard_map.py)")
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from jaxcomm import JaxComm

    mesh = Mesh(np.array(jax.local_devices()[:1]), ("x",))
    jx = JaxComm.for_mesh(mesh, "x")
    try:
        operands, outputs, args = _pattern(jx, 2, (3,))
        indices = _int(args[0])
        exchange = _ragged(jx, form)
        want = np.tanh(ragged_model([o * 2 for o in operands], outputs, args)[0])

        def run(axis_name):
            body = partial(_exchange_written_for_jax, exchange, axis_name=axis_name)
            mapped = jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
            return jax.jit(mapped)(operands[0], outputs[0], indices)

        for axis_name in ("x", ("x",)):
            np.testing.assert_allclose(run(axis_name), want, rtol=1e-6)
        # JAX's own collective lowers from the same function (XLA:CPU cannot run it).
        body = partial(_exchange_written_for_jax, jax.lax.ragged_all_to_all, axis_name="x")
        mapped = jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
        assert (
            "ragged_all_to_all" in jax.jit(mapped).lower(operands[0], outputs[0], indices).as_text()
        )
        for axis_name, error, reason in (
            ("y", ValueError, "communicates along the mesh axes"),
            (("x", "x"), ValueError, "communicates along the mesh axes"),
            (["x", 1], TypeError, "axis_name must be a mesh axis name"),
        ):
            with pytest.raises(error, match=reason):
                run(axis_name)
    finally:
        jx.free()
