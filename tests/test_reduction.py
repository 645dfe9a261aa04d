"""allreduce: every op/dtype pair MPI allows, shapes, jit, control flow, errors."""

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
    stack = np.stack([op_input(r, shape, dtype, name) for r in range(size)])
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
        with pytest.raises(ValueError, match="user-defined"):
            jc.allreduce(jnp.zeros(3), op=user_op)
    finally:
        user_op.Free()


def test_allreduce_rejects_non_arrays(jc):
    with pytest.raises(TypeError, match="x must be an array"):
        jc.allreduce("abc")
    with pytest.raises(TypeError, match="x must be an array"):
        jc.allreduce(None)
    with pytest.raises(TypeError, match="jaxcomm cannot send"):
        jc.allreduce(jnp.zeros(3, jnp.float8_e4m3fn), op=MPI.MAX)
