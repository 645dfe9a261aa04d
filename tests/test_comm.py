"""Communicator management: split, Cartesian grids, neighbour shifts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

from jaxcomm import JaxComm


@pytest.mark.mpi
def test_split_by_parity_and_ordering_with_parent(jc):
    sub = jc.split(color=jc.rank % 2, key=-jc.rank)  # reversed order inside
    members = [r for r in range(jc.size) if r % 2 == jc.rank % 2]
    assert sub.size == len(members)
    assert sub.rank == len(members) - 1 - members.index(jc.rank)

    @jax.jit
    def both(x):
        # Parent and child calls interleaved in one function stay in order.
        a = jc.allreduce(x)
        b = sub.allreduce(x)
        c = jc.bcast(b, root=0)
        d = sub.bcast(a, root=sub.size - 1)
        return a, b, c, d

    for _ in range(5):
        a, b, c, d = both(jnp.full(3, float(jc.rank)))
        np.testing.assert_array_equal(a, np.full(3, float(sum(range(jc.size)))))
        np.testing.assert_array_equal(b, np.full(3, float(sum(members))))
        np.testing.assert_array_equal(
            c, np.full(3, float(sum(r for r in range(jc.size) if r % 2 == 0)))
        )
        np.testing.assert_array_equal(d, a)
    sub.free()


@pytest.mark.mpi
def test_split_undefined_gives_none(jc):
    color = MPI.UNDEFINED if jc.rank == 0 else 1
    sub = jc.split(color)
    if jc.rank == 0:
        assert sub is None
    else:
        assert sub.size == jc.size - 1
        assert int(sub.allreduce(1)) == jc.size - 1
        sub.free()


def test_split_rejects_bad_colors(jc):
    with pytest.raises(ValueError, match="color=-5"):
        jc.split(-5)
    with pytest.raises(TypeError, match="color must be an int"):
        jc.split("red")


@pytest.mark.mpi
def test_from_cart_properties_and_shift():
    size = MPI.COMM_WORLD.size
    grid = JaxComm.from_cart([0], periods=[True])
    assert grid.dims == (size,) and grid.periods == (True,)
    assert grid.coords == (grid.rank,)
    left, right = grid.cart_shift(0)
    assert (left, right) == ((grid.rank - 1) % size, (grid.rank + 1) % size)
    got = jax.jit(lambda x: grid.shift(x, 0, disp=1))(jnp.full(2, grid.rank))
    np.testing.assert_array_equal(got, np.full(2, left))
    grid.free()

    line = JaxComm.from_cart([size, 1])  # not periodic: the ends get zeros
    assert line.dims == (size, 1) and line.periods == (False, False)
    got = line.shift(jnp.full(3, 10.0 + line.rank), direction=0, disp=1)
    want = np.zeros(3) if line.rank == 0 else np.full(3, 10.0 + line.rank - 1)
    np.testing.assert_array_equal(got, want)
    got = line.shift(jnp.full(3, 10.0 + line.rank), direction=0, disp=-1)
    want = np.zeros(3) if line.rank == size - 1 else np.full(3, 11.0 + line.rank)
    np.testing.assert_array_equal(got, want)
    # Axis 1 has one process: shifting along it talks to nobody.
    assert line.cart_shift(1) == (MPI.PROC_NULL, MPI.PROC_NULL)
    line.free()


def test_from_cart_rejects_bad_grids(jc):
    size = MPI.COMM_WORLD.size
    with pytest.raises(ValueError, match="does not hold"):
        JaxComm.from_cart([size + 1])
    with pytest.raises(ValueError, match="periods has 2 entries"):
        JaxComm.from_cart([size], periods=[True, False])
    with pytest.raises(ValueError, match="non-empty"):
        JaxComm.from_cart([])
    with pytest.raises(TypeError, match="Intracomm"):
        JaxComm.from_cart([size], comm="world")
    with pytest.raises(TypeError, match="no Cartesian topology"):
        jc.cart_shift(0)
    with pytest.raises(TypeError, match="no Cartesian topology"):
        _ = jc.coords


@pytest.mark.mpi
def test_cart_shift_rejects_bad_direction():
    grid = JaxComm.from_cart([0])
    with pytest.raises(ValueError, match="direction=1"):
        grid.cart_shift(1)
    grid.free()
