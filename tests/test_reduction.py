"""The reduction family: allreduce, reduce, scan, exscan, reduce_scatter.

Every op/dtype pair MPI allows, shapes, every root, jit, control flow, errors.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ALL_DTYPES, SHAPES, rank_data, unchanged
from mpi4py import MPI

from jaxcomm.ops._base import ALLOWED_DTYPES

OPS = {
    "SUM": MPI.SUM,
    "PROD": MPI.PROD,
    "MIN": MPI.MIN,
    "MAX": MPI.MAX,
    "LAND": MPI.LAND,
    "LOR": MPI.LOR,
    "LXOR": MPI.LXOR,
    "BAND": MPI.BAND,
    "BOR": MPI.BOR,
    "BXOR": MPI.BXOR,
}

VALID = [(name, dt) for name in OPS for dt in ALL_DTYPES if dt in ALLOWED_DTYPES[name]]
INVALID = [(name, dt) for name in OPS for dt in ALL_DTYPES if dt not in ALLOWED_DTYPES[name]]


def op_input(rank, shape, dtype, name):
    # PROD stays within int8 for 3 ranks with factors 1 and 2.
    high = 3 if name == "PROD" else 5
    low = 1 if name == "PROD" else 0
    return rank_data(rank, shape, dtype, low=low, high=high)


def expected(size, shape, dtype, name):
    return combine([op_input(r, shape, dtype, name) for r in range(size)], dtype, name)


def combine(inputs, dtype, name):
    """The reduction of a list of per-rank inputs, computed with NumPy."""
    stack = np.stack(inputs)
    wide = stack.astype(np.complex128 if np.iscomplexobj(stack) else np.float64)
    if name == "SUM":
        out = wide.sum(axis=0)
    elif name == "PROD":
        out = wide.prod(axis=0)
    elif name == "MIN":
        out = stack.min(axis=0)
    elif name == "MAX":
        out = stack.max(axis=0)
    elif name.startswith("L"):
        fn = {"LAND": np.logical_and, "LOR": np.logical_or, "LXOR": np.logical_xor}[name]
        out = fn.reduce(stack != 0, axis=0)
    else:
        fn = {"BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor}[name]
        out = fn.reduce(stack, axis=0)
    return np.asarray(out).astype(dtype)


@pytest.mark.mpi
@pytest.mark.parametrize("name,dtype", VALID, ids=[f"{n}-{d}" for n, d in VALID])
def test_allreduce_every_op_dtype_eager(jc, name, dtype):
    x = op_input(jc.rank, (3, 4), dtype, name)
    original = x.copy()
    y = jc.allreduce(jnp.asarray(x), op=OPS[name])
    assert y.shape == x.shape and y.dtype == dtype
    np.testing.assert_array_equal(np.asarray(y), expected(jc.size, (3, 4), dtype, name))
    unchanged(x, original)


@pytest.mark.mpi
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_allreduce_shapes_jit(jc, shape, dtype):
    name = "LOR" if dtype == np.dtype(bool) else "SUM"
    x = jnp.asarray(op_input(jc.rank, shape, dtype, name))
    before = np.asarray(x).copy()
    y = jax.jit(lambda v: jc.allreduce(v, op=OPS[name]))(x)
    assert y.shape == shape and y.dtype == dtype
    np.testing.assert_array_equal(np.asarray(y), expected(jc.size, shape, dtype, name))
    unchanged(x, before)


@pytest.mark.mpi
def test_allreduce_numpy_and_scalar_inputs(jc):
    x = np.full(4, jc.rank, dtype=np.int32)
    original = x.copy()
    np.testing.assert_array_equal(jc.allreduce(x), np.full(4, sum(range(jc.size))))
    unchanged(x, original)
    assert float(jc.allreduce(1.5)) == 1.5 * jc.size
    assert int(jc.allreduce(jc.rank, op=MPI.MAX)) == jc.size - 1


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ["float16", jnp.bfloat16], ids=["float16", "bfloat16"])
def test_half_precision_reductions_round_like_jax(jc, dtype):
    # Values that are not exact in half precision: the user-defined op must
    # round like a float32 computation cast back, as XLA does.
    x = jnp.asarray(np.linspace(0.1, 3.3, 11) * (jc.rank + 1), dtype=dtype)
    contributions = [
        jnp.asarray(np.linspace(0.1, 3.3, 11) * (r + 1), dtype=dtype) for r in range(jc.size)
    ]
    for op, fn in ((MPI.MIN, jnp.minimum), (MPI.MAX, jnp.maximum)):
        want = contributions[0]
        for c in contributions[1:]:
            want = fn(want, c)
        np.testing.assert_array_equal(np.asarray(jc.allreduce(x, op=op)), np.asarray(want))
    got = np.asarray(jc.allreduce(x), dtype=np.float64)
    exact = sum(np.asarray(c, dtype=np.float64) for c in contributions)
    np.testing.assert_allclose(got, exact, rtol=2e-2 if dtype == jnp.bfloat16 else 2e-3)


@pytest.mark.mpi
def test_half_precision_special_values(jc):
    x = jnp.asarray([jnp.inf, -jnp.inf, 0.0, -0.0, 65504.0, 6e-8], dtype=jnp.float16)
    y = np.asarray(jc.allreduce(x, op=MPI.MAX))
    np.testing.assert_array_equal(y, np.asarray(x))
    nan = np.asarray(jc.allreduce(jnp.asarray([jnp.nan], dtype=jnp.float16)))
    assert np.isnan(nan).all()


@pytest.mark.mpi
def test_allreduce_in_control_flow(jc):
    size = jc.size

    @jax.jit
    def loop(x):
        return jax.lax.fori_loop(0, 5, lambda i, v: jc.allreduce(v) / size + i, x)

    x = jnp.arange(4.0) + jc.rank
    want = np.arange(4.0) + (size - 1) / 2 + sum(range(5))
    np.testing.assert_allclose(loop(x), want)

    def step(carry, v):
        s = jc.allreduce(v)
        return carry + s, s

    total, sums = jax.jit(lambda xs: jax.lax.scan(step, 0.0, xs))(jnp.arange(6.0) * (jc.rank + 1))
    scale = size * (size + 1) / 2
    np.testing.assert_allclose(sums, np.arange(6.0) * scale)
    np.testing.assert_allclose(total, 15.0 * scale)

    @jax.jit
    def branch(flag, v):
        return jax.lax.cond(flag, lambda u: jc.allreduce(u, op=MPI.MAX), lambda u: -u, v)

    v = jnp.full(3, float(jc.rank))
    np.testing.assert_array_equal(branch(True, v), np.full(3, size - 1.0))
    np.testing.assert_array_equal(branch(False, v), -np.asarray(v))

    def body(state):
        i, v = state
        return i + 1, jc.allreduce(v, op=MPI.MIN) + 1

    _, out = jax.jit(lambda v: jax.lax.while_loop(lambda s: s[0] < 4, body, (0, v)))(v)
    np.testing.assert_array_equal(out, np.full(3, 4.0))


@pytest.mark.parametrize("name,dtype", INVALID, ids=[f"{n}-{d}" for n, d in INVALID])
def test_allreduce_rejects_op_dtype_pairs_mpi_does_not_define(jc, name, dtype):
    with pytest.raises(TypeError, match=f"MPI.{name} is not defined for dtype"):
        jc.allreduce(jnp.zeros(3, dtype), op=OPS[name])


def test_allreduce_rejects_bad_op(jc):
    with pytest.raises(TypeError, match="op must be"):
        jc.allreduce(jnp.zeros(3), op="sum")
    user_op = MPI.Op.Create(lambda a, b, t: None, commute=True)
    try:
        with pytest.raises(ValueError, match="user-defined MPI.Op .* JAX can neither trace"):
            jc.allreduce(jnp.zeros(3), op=user_op)
    finally:
        user_op.Free()


@pytest.mark.parametrize("name", ["MAXLOC", "MINLOC"])
def test_maxloc_and_minloc_are_refused_with_the_reason_and_a_way_out(jc, name):
    # MPI defines them on (value, index) pairs only; passed to MPI with a
    # float buffer they would be an MPI error on some ranks, or garbage.
    with pytest.raises(ValueError, match=rf"MPI.{name} is not supported: .*pair.*two reductions"):
        jc.allreduce(jnp.zeros(3), op=getattr(MPI, name))


def test_one_sided_ops_are_refused_as_such(jc):
    with pytest.raises(ValueError, match="one-sided accumulation"):
        jc.allreduce(jnp.zeros(3), op=MPI.REPLACE)


def test_allreduce_rejects_non_arrays(jc):
    with pytest.raises(TypeError, match="x must be an array"):
        jc.allreduce("abc")
    with pytest.raises(TypeError, match="x must be an array"):
        jc.allreduce(None)
    with pytest.raises(TypeError, match="jaxcomm cannot send"):
        jc.allreduce(jnp.zeros(3, jnp.float8_e4m3fn), op=MPI.MAX)


# reduce, scan, exscan, reduce_scatter ---------------------------------------

JIT_DTYPES = [
    np.dtype(t) for t in ("bool", "int32", "uint8", "float16", jnp.bfloat16, "float64", "complex64")
]


FAMILY = ("reduce", "scan", "exscan", "reduce_scatter")


def logical_or_sum(dtype):
    return "LOR" if dtype == np.dtype(bool) else "SUM"


def prefix_expected(method, rank, size, shape, dtype, name):
    """What ``scan``/``exscan`` return on ``rank``."""
    inputs = [op_input(r, shape, dtype, name) for r in range(size)]
    if method == "scan":
        return combine(inputs[: rank + 1], dtype, name)
    return combine(inputs[:rank], dtype, name) if rank else np.zeros(shape, dtype)


def reduce_expected(rank, size, shape, dtype, name, root):
    if rank != root:
        return np.zeros(shape, dtype)
    return expected(size, shape, dtype, name)


def scatter_expected(rank, size, shape, dtype, name, tiled):
    """``reduce_scatter``'s block on ``rank`` for per-rank inputs of ``shape``."""
    total = expected(size, shape, dtype, name)
    if not tiled:
        return total[rank]
    k = shape[0] // size
    return total[rank * k : (rank + 1) * k]


def check(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype, (got, want)
    np.testing.assert_array_equal(np.asarray(got), want)


# Eager calls compile one small program each: every op/dtype pair runs once,
# through the four methods in turn, so each method meets every op.
ROTATED = [(name, dtype, FAMILY[i % 4]) for i, (name, dtype) in enumerate(VALID)]


@pytest.mark.mpi
@pytest.mark.parametrize("name,dtype,method", ROTATED, ids=[f"{m}-{n}-{d}" for n, d, m in ROTATED])
def test_family_every_op_dtype_eager(jc, name, dtype, method):
    rank, size, op = jc.rank, jc.size, OPS[name]
    shape = (size, 3) if method == "reduce_scatter" else (3, 2)
    original = op_input(rank, shape, dtype, name)
    x = jnp.asarray(original)
    if method == "reduce_scatter":
        got = jc.reduce_scatter(x, op=op)
        want = scatter_expected(rank, size, shape, dtype, name, tiled=False)
    elif method == "reduce":
        got = jc.reduce(x, op=op, root=size - 1)
        want = reduce_expected(rank, size, shape, dtype, name, root=size - 1)
    else:
        got = getattr(jc, method)(x, op=op)
        want = prefix_expected(method, rank, size, shape, dtype, name)
    check(got, want)
    unchanged(x, original)


@pytest.mark.mpi
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", JIT_DTYPES, ids=str)
def test_reduce_scan_exscan_shapes_jit(jc, shape, dtype):
    rank, size = jc.rank, jc.size
    name = logical_or_sum(dtype)
    op = OPS[name]
    x = jnp.asarray(op_input(rank, shape, dtype, name))
    before = np.asarray(x).copy()

    @jax.jit
    def every_call(v):
        roots = [jc.reduce(v, op=op, root=root) for root in range(size)]
        return roots, jc.scan(v, op=op), jc.exscan(v, op=op)

    roots, scan, exscan = every_call(x)
    for root, got in enumerate(roots):
        check(got, reduce_expected(rank, size, shape, dtype, name, root))
    check(scan, prefix_expected("scan", rank, size, shape, dtype, name))
    check(exscan, prefix_expected("exscan", rank, size, shape, dtype, name))
    unchanged(x, before)


@pytest.mark.mpi
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", JIT_DTYPES, ids=str)
def test_reduce_scatter_shapes_jit(jc, shape, dtype):
    rank, size = jc.rank, jc.size
    name = logical_or_sum(dtype)
    # shape is the block each rank gets; tiled blocks are 2 rows of it.
    stacked = jnp.asarray(op_input(rank, (size, *shape), dtype, name))
    tiled = jnp.asarray(op_input(rank, (2 * size, *shape), dtype, name))
    before = np.asarray(stacked).copy(), np.asarray(tiled).copy()
    got = jax.jit(
        lambda s, t: (
            jc.reduce_scatter(s, op=OPS[name]),
            jc.reduce_scatter(t, op=OPS[name], tiled=True),
        )
    )(stacked, tiled)
    check(got[0], scatter_expected(rank, size, (size, *shape), dtype, name, tiled=False))
    check(got[1], scatter_expected(rank, size, (2 * size, *shape), dtype, name, tiled=True))
    unchanged(stacked, before[0])
    unchanged(tiled, before[1])


@pytest.mark.mpi
def test_reduce_every_root_eager_numpy_and_scalar_inputs(jc):
    rank, size = jc.rank, jc.size
    x = np.full(4, rank, dtype=np.int32)
    original = x.copy()
    for root in range(size):
        want = np.full(4, sum(range(size)) if rank == root else 0)
        np.testing.assert_array_equal(jc.reduce(x, root=root), want)
        assert float(jc.reduce(1.5, root=root)) == (1.5 * size if rank == root else 0.0)
        got = jc.reduce(rank, op=MPI.MAX, root=root)
        assert got.shape == () and int(got) == (size - 1 if rank == root else 0)
    unchanged(x, original)
    assert int(jc.scan(1)) == rank + 1
    assert int(jc.exscan(1)) == rank
    np.testing.assert_array_equal(jc.exscan(x, op=MPI.MAX), np.full(4, max(rank - 1, 0)))
    unchanged(x, original)


@pytest.mark.x64
@pytest.mark.mpi
def test_reduce_scatter_tiled_splits_rows_and_empty_blocks(jc):
    rank, size = jc.rank, jc.size
    x = np.arange(3 * size * 2, dtype=np.float64).reshape(3 * size, 2) * (rank + 1)
    total = np.arange(3 * size * 2, dtype=np.float64).reshape(3 * size, 2) * size * (size + 1) / 2
    np.testing.assert_array_equal(jc.reduce_scatter(x, tiled=True), total[3 * rank : 3 * rank + 3])
    check(jc.reduce_scatter(jnp.zeros((0, 5)), tiled=True), np.zeros((0, 5)))
    check(jc.reduce_scatter(jnp.zeros((size, 0), jnp.int8)), np.zeros(0, np.int8))


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["LAND", "LOR", "LXOR"])
def test_logical_ops_give_0_1_for_integers(jc, name):
    rank, size = jc.rank, jc.size
    # 2 and 4 are true but share no bits: only 0/1 normalisation gets these right.
    x = np.array([2 + 2 * rank, 0, 4 if rank % 2 else 0], dtype=np.int16)
    truth = [np.array([True, False, r % 2 == 1]) for r in range(size)]
    fn = {"LAND": np.logical_and, "LOR": np.logical_or, "LXOR": np.logical_xor}[name]
    scan = fn.reduce(np.stack(truth[: rank + 1]), axis=0).astype(np.int16)
    np.testing.assert_array_equal(jc.scan(x, op=OPS[name]), scan)
    root = fn.reduce(np.stack(truth), axis=0).astype(np.int16)
    on_root = jc.reduce(x, op=OPS[name])
    np.testing.assert_array_equal(on_root, root if rank == 0 else np.zeros_like(root))
    stacked = np.broadcast_to(x, (size, 3))
    np.testing.assert_array_equal(jc.reduce_scatter(stacked, op=OPS[name]), root)


@pytest.mark.mpi
def test_reduce_scan_exscan_reduce_scatter_in_control_flow(jc):
    rank, size = jc.rank, jc.size

    def body(i, state):
        a, b, c, d = state
        a = jc.scan(a) / size + i
        b = jc.exscan(b) + 1
        c = jc.reduce(c, root=size - 1) + 1
        d = jc.reduce_scatter(jnp.broadcast_to(d, (size, *d.shape))) + rank
        return a, b, c, d

    start = jnp.arange(3.0) + rank
    got = jax.jit(lambda s: jax.lax.fori_loop(0, 4, body, (s, s, s, s)))(start)

    # The same loop over every rank's state at once, in NumPy.
    ranks = [np.arange(3.0) + r for r in range(size)]
    a, b, c, d = (list(ranks) for _ in range(4))
    for i in range(4):
        a = [sum(a[: r + 1]) / size + i for r in range(size)]
        b = [sum(b[:r], np.zeros(3)) + 1 for r in range(size)]
        c = [(sum(c) if r == size - 1 else np.zeros(3)) + 1 for r in range(size)]
        d = [sum(d) + r for r in range(size)]
    for out, want in zip(got, (a, b, c, d)):
        np.testing.assert_allclose(np.asarray(out), want[rank])

    def step(carry, v):
        s = jc.exscan(v, op=MPI.MAX)
        return carry + s, jc.reduce_scatter(jnp.stack([v] * size), tiled=True)

    xs = jnp.arange(6.0).reshape(6, 1) * (rank + 1)
    total, blocks = jax.jit(lambda v: jax.lax.scan(step, jnp.zeros(1), v))(xs)
    np.testing.assert_allclose(total, [15.0 * rank])
    np.testing.assert_allclose(blocks, np.arange(6.0).reshape(6, 1, 1) * size * (size + 1) / 2)

    @jax.jit
    def branch(flag, v):
        return jax.lax.cond(flag, lambda u: jc.scan(u, op=MPI.MIN), lambda u: -u, v)

    v = jnp.full(3, float(size - rank))
    np.testing.assert_array_equal(branch(True, v), np.full(3, size - rank))
    np.testing.assert_array_equal(branch(False, v), -np.asarray(v))


def call(jc, method, x, **kwargs):
    if method == "reduce_scatter" and getattr(x, "ndim", 0) == 1:
        x = jnp.broadcast_to(x, (jc.size, *x.shape))
    return getattr(jc, method)(x, **kwargs)


@pytest.mark.parametrize("name,dtype", INVALID, ids=[f"{n}-{d}" for n, d in INVALID])
def test_family_rejects_op_dtype_pairs_mpi_does_not_define(jc, name, dtype):
    for method in FAMILY:
        with pytest.raises(TypeError, match=f"MPI.{name} is not defined for dtype"):
            call(jc, method, jnp.zeros(3, dtype), op=OPS[name])


def test_family_rejects_bad_ops_and_non_arrays(jc):
    user_op = MPI.Op.Create(lambda a, b, t: None, commute=True)
    try:
        for method in FAMILY:
            with pytest.raises(TypeError, match="op must be"):
                call(jc, method, jnp.zeros(3), op="sum")
            with pytest.raises(ValueError, match="user-defined"):
                call(jc, method, jnp.zeros(3), op=user_op)
            with pytest.raises(TypeError, match="x must be an array"):
                getattr(jc, method)("abc")
            with pytest.raises(TypeError, match="jaxcomm cannot send"):
                getattr(jc, method)(jnp.zeros(3, jnp.float8_e4m3fn), op=MPI.MAX)
    finally:
        user_op.Free()


def test_reduce_rejects_bad_roots(jc):
    x = jnp.zeros(3)
    for root in (jc.size, -1):
        with pytest.raises(ValueError, match=f"root={root} is not a rank"):
            jc.reduce(x, root=root)
    for root in (1.0, True, "0"):
        with pytest.raises(TypeError, match="root must be"):
            jc.reduce(x, root=root)
    with pytest.raises(TypeError, match="root must be a static Python int"):
        jax.jit(lambda r: jc.reduce(x, root=r))(0)


def test_reduce_scatter_rejects_bad_leading_axes(jc):
    size = jc.size
    for bad in (jnp.zeros(()), jnp.zeros((size + 1, 2)), jnp.zeros(size + 1)):
        with pytest.raises(ValueError, match=f"x must have a leading axis of length {size} "):
            jc.reduce_scatter(bad)
    with pytest.raises(ValueError, match=f"multiple of the communicator size {size}"):
        jc.reduce_scatter(jnp.zeros(()), tiled=True)
    if size > 1:
        with pytest.raises(ValueError, match=f"multiple of the communicator size {size}"):
            jc.reduce_scatter(jnp.zeros((size + 1, 2)), tiled=True)
    with pytest.raises(TypeError, match="tiled must be a static bool"):
        jc.reduce_scatter(jnp.zeros((size, 2)), tiled=1)


# NaN, signed zeros and infinities in MIN and MAX -----------------------------
#
# MIN and MAX follow jnp.minimum and jnp.maximum: a NaN on any rank gives NaN,
# -0 is below +0, and every rank gets the same result whatever order MPI
# combines the ranks' values in.

FLOATS = [np.dtype("float16"), np.dtype(jnp.bfloat16), np.dtype("float32"), np.dtype("float64")]
EXTREMA = {"MIN": jnp.minimum, "MAX": jnp.maximum}


def special_input(rank, size, dtype):
    """A NaN on the first rank only and on the last rank only, signed zeros, infinities."""
    x = np.array([1.0 + rank, 2.0 - rank, 0.0, 0.0, -1.0, 3.0, 5.0 * rank])
    x[0] = np.nan if rank == 0 else x[0]
    x[1] = np.nan if rank == size - 1 else x[1]
    x[2] = -0.0 if rank % 2 else 0.0
    x[3] = 0.0 if rank % 2 else -0.0
    x[4] = np.inf if rank == size - 1 else x[4]
    x[5] = -np.inf if rank == 0 else x[5]
    return jnp.asarray(x, dtype)


def extremum(name, inputs):
    out = inputs[0]
    for x in inputs[1:]:
        out = EXTREMA[name](out, x)
    return np.asarray(out)


def check_special(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype
    # In float64, where NumPy knows NaN for every dtype.
    got, want = got.astype(np.float64), want.astype(np.float64)
    np.testing.assert_array_equal(got, want)  # NaN exactly where want has it
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


def same_on_every_rank(jc, got):
    """Assert that every rank holds the same bits."""
    everyone = jc.comm.allgather(np.asarray(got).tobytes())
    assert all(b == everyone[0] for b in everyone)


@pytest.mark.mpi
@pytest.mark.parametrize("method", ("allreduce", *FAMILY))
@pytest.mark.parametrize("name", EXTREMA)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_min_max_propagate_nan_like_jax(jc, dtype, name, method):
    rank, size, op = jc.rank, jc.size, OPS[name]
    inputs = [special_input(r, size, dtype) for r in range(size)]
    x = inputs[rank]
    zeros = np.zeros(x.shape, dtype)
    if method == "allreduce":
        got, want = jc.allreduce(x, op=op), extremum(name, inputs)
    elif method == "reduce_scatter":
        got = jc.reduce_scatter(jnp.broadcast_to(x, (size, *x.shape)), op=op)
        want = extremum(name, inputs)
    elif method == "reduce":
        got = jc.reduce(x, op=op, root=size - 1)
        want = extremum(name, inputs) if rank == size - 1 else zeros
    elif method == "scan":
        got, want = jc.scan(x, op=op), extremum(name, inputs[: rank + 1])
    else:
        got = jc.exscan(x, op=op)
        want = extremum(name, inputs[:rank]) if rank else zeros
    check_special(got, want)
    if method in ("allreduce", "reduce_scatter"):
        same_on_every_rank(jc, got)


@pytest.mark.mpi
@pytest.mark.parametrize(
    "nbytes",
    [(256 << 10) - 4, 256 << 10, (1 << 20) + 12],
    ids=["under-256KiB", "256KiB", "1MiB"],
)
def test_reduce_large_kept_argument_zeros_off_root(jc, nbytes):
    # Off the root the result is zeros. A later call reuses freed buffers that
    # held an earlier call's sums, so a zero fill that fell short would leave
    # them here.
    n = nbytes // 4
    base = np.arange(n, dtype=np.float32)
    total = sum(range(jc.size))
    jitted = jax.jit(lambda v, root: jc.reduce(v, root=root), static_argnums=1)
    for call in range(3):
        for root in range(jc.size):
            x = jnp.asarray(base + jc.rank + 10 * call)
            want = jc.size * base + total + 10 * call * jc.size
            if jc.rank != root:
                want = np.zeros_like(want)
            np.testing.assert_array_equal(np.asarray(jitted(x, root)), want)
            np.testing.assert_array_equal(np.asarray(jc.reduce(x, root=root)), want)
            unchanged(x, base + jc.rank + 10 * call)
