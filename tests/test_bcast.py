"""bcast: every root, dtypes, shapes, jit, control flow, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ALL_DTYPES, SHAPES, rank_data, unchanged


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_bcast_every_root_eager(jc, dtype):
    for root in range(jc.size):
        x = rank_data(jc.rank, (2, 3), dtype)
        original = x.copy()
        y = jc.bcast(x, root=root)
        assert y.dtype == dtype and y.shape == (2, 3)
        np.testing.assert_array_equal(np.asarray(y), rank_data(root, (2, 3), dtype))
        unchanged(x, original)


@pytest.mark.mpi
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", ["float32", "int64", "complex128", "bool"])
def test_bcast_shapes_jit(jc, shape, dtype):
    dtype = np.dtype(dtype)
    x = jnp.asarray(rank_data(jc.rank, shape, dtype))
    for root in range(jc.size):
        y = jax.jit(lambda v, root=root: jc.bcast(v, root=root))(x)
        np.testing.assert_array_equal(np.asarray(y), rank_data(root, shape, dtype))
    unchanged(x, rank_data(jc.rank, shape, dtype))


@pytest.mark.mpi
def test_bcast_in_loops_and_cond(jc):
    size = jc.size

    @jax.jit
    def rotate(x):
        # Each iteration broadcasts from a different root: a reordering would
        # pair up different roots across ranks.
        branches = [lambda v, r=r: jc.bcast(v, root=r) for r in range(size)]

        def body(i, acc):
            return acc + jax.lax.switch(i % size, branches, x)

        return jax.lax.fori_loop(0, 2 * size, body, jnp.zeros_like(x))

    x = jnp.full(3, 10.0 * jc.rank)
    np.testing.assert_allclose(rotate(x), np.full(3, 20.0 * sum(range(size))))

    def step(carry, root_value):
        return carry, jc.bcast(root_value * (jc.rank + 1), root=0)

    _, ys = jax.jit(lambda xs: jax.lax.scan(step, 0.0, xs))(jnp.arange(4.0))
    np.testing.assert_allclose(ys, np.arange(4.0))


@pytest.mark.mpi
@pytest.mark.parametrize(
    "nbytes",
    [(256 << 10) - 4, 256 << 10, (1 << 20) + 12, (9 << 20) + 4],
    ids=["under-256KiB", "256KiB", "1MiB", "9MiB-in-pieces"],
)
def test_bcast_large_kept_argument(jc, nbytes):
    # The root hands MPI its argument as it is and copies it into its result
    # beside the transfer (on a helper thread from 256 KiB). Every call's
    # values differ, so a copy that fell short would leave an earlier call's
    # values in a reused buffer and fail here.
    n = nbytes // 4
    base = np.arange(n, dtype=np.float32)
    jitted = jax.jit(lambda v, root: jc.bcast(v, root=root), static_argnums=1)
    for call in range(3):
        for root in range(jc.size):
            x = jnp.asarray(base + 1000 * jc.rank + 10 * call)
            expected = base + 1000 * root + 10 * call
            np.testing.assert_array_equal(np.asarray(jitted(x, root)), expected)
            np.testing.assert_array_equal(np.asarray(jc.bcast(x, root=root)), expected)
            unchanged(x, base + 1000 * jc.rank + 10 * call)


def test_bcast_rejects_bad_roots(jc):
    x = jnp.zeros(3)
    with pytest.raises(ValueError, match="root=-1"):
        jc.bcast(x, root=-1)
    with pytest.raises(ValueError, match=f"root={jc.size}"):
        jc.bcast(x, root=jc.size)
    with pytest.raises(TypeError, match="root must be an int"):
        jc.bcast(x, root=0.0)
    with pytest.raises(TypeError, match="root must be a static Python int"):
        jax.jit(lambda r: jc.bcast(x, root=r))(0)
