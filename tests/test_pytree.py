"""Pytrees: same structure back, one MPI call per dtype.

Every row of ``operations.py`` marked ``pytree`` runs on a pytree whose leaves
are the row's input in two dtypes and two shapes, on every rotation of the
ranks; the other tests cover what is particular to pytrees.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import backend_compiles, mpi_debug, rank_data, unmonitored
from mpi4py import MPI
from operations import params, rotations, select


def model_tree(rank, leaves=100):
    """A gradient-like pytree: 60 float32 leaves, 40 int32, mixed shapes."""
    tree = {"layers": [], "step": jnp.asarray(rank, jnp.int32)}
    for i in range(leaves // 2):
        tree["layers"].append(
            {
                "w": jnp.full((i % 4 + 1, 3), float(rank + i), jnp.float32),
                "b": jnp.full((i % 3,), rank * 10 + i, jnp.int32)
                if i % 5
                else jnp.full((2,), float(i), jnp.float32),
            }
        )
    return tree


def mpi_calls(err, name):
    return [line for line in err.splitlines() if line.startswith("r") and f"| {name}" in line]


@pytest.mark.mpi
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_allreduce_gradient_pytree_costs_one_call_per_dtype(jc, capfd, jit):
    tree = model_tree(jc.rank)
    fn = jax.jit(jc.allreduce) if jit else jc.allreduce
    fn(tree)  # compile outside the counted call
    capfd.readouterr()
    with mpi_debug():
        out = jax.block_until_ready(fn(tree))
    calls = mpi_calls(capfd.readouterr().err, "MPI_Allreduce")
    assert len(jax.tree_util.tree_leaves(tree)) == 101
    assert len(calls) == 2, calls  # float32 and int32
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(tree)
    trees = [model_tree(r) for r in range(jc.size)]
    want = jax.tree_util.tree_map(lambda *xs: sum(np.asarray(x) for x in xs), *trees)
    for got, expected, leaf in zip(
        jax.tree_util.tree_leaves(out),
        jax.tree_util.tree_leaves(want),
        jax.tree_util.tree_leaves(tree),
    ):
        assert got.dtype == leaf.dtype and got.shape == leaf.shape
        np.testing.assert_array_equal(np.asarray(got), expected)


@pytest.mark.mpi
def test_bcast_pytree_and_mixed_leaf_kinds(jc):
    tree = (jnp.arange(3.0) + jc.rank, {"n": np.int64(jc.rank), "flag": jc.rank % 2 == 0}, [2.5])
    for root in range(jc.size):
        out = jc.bcast(tree, root=root)
        np.testing.assert_array_equal(out[0], np.arange(3.0) + root)
        assert int(out[1]["n"]) == root and bool(out[1]["flag"]) == (root % 2 == 0)
        assert float(out[2][0]) == 2.5
        assert isinstance(out[2], list)


@pytest.mark.mpi
def test_pytree_ops_in_fori_loop_and_reduction_rules(jc):
    @jax.jit
    def loop(tree):
        return jax.lax.fori_loop(0, 3, lambda i, t: jc.allreduce(t, op=MPI.MAX), tree)

    out = loop({"a": jnp.full(2, float(jc.rank)), "b": jnp.asarray(-jc.rank)})
    np.testing.assert_array_equal(out["a"], np.full(2, jc.size - 1.0))
    assert int(out["b"]) == 0
    with pytest.raises(TypeError, match="MPI.SUM is not defined for dtype bool"):
        jc.allreduce({"ok": jnp.ones(2), "bad": jnp.ones(2, bool)})
    with pytest.raises(ValueError, match="no arrays"):
        jc.allreduce({})


@unmonitored
@pytest.mark.mpi
def test_eager_pytree_calls_reuse_compiled_code(jc):
    tree = {"a": jnp.ones(3), "b": [jnp.zeros(2), jnp.ones((), jnp.int32)]}
    jc.allreduce(tree)
    with backend_compiles() as compiles:
        for _ in range(5):
            jax.block_until_ready(jc.allreduce(tree))
    assert compiles == []


def row_tree(op, size, rank):
    """``rank``'s pytree for a row: its input as float32 and int32, and a float leaf of shape (1,).

    The last has another length of leading axis and another number of axes
    than the input, both packed into the same float32 call.
    """
    shape = op.shape(size, rank)
    return {
        "a": rank_data(rank, shape, np.dtype(np.float32)),
        "b": [rank_data(rank, shape, np.dtype(np.int32))],
        "c": rank_data(rank + 1, (1,), np.dtype(np.float32)),
    }


@pytest.mark.mpi
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("op", params(select(pytree=True)))
def test_pytree_is_the_row_per_leaf_in_one_call_per_dtype(jc, capfd, op, jit):
    for comm in rotations(jc):
        trees = [row_tree(op, comm.size, r) for r in range(comm.size)]
        want = jax.tree.map(
            lambda *leaves: op.expected(lambda r: leaves[r], comm.rank, comm.size), *trees
        )
        tree = jax.tree.map(jnp.asarray, trees[comm.rank])
        fn = jax.jit(lambda t: op.call(comm, t)) if jit else (lambda t: op.call(comm, t))
        capfd.readouterr()
        with mpi_debug():
            out = jax.block_until_ready(fn(tree))
        calls = mpi_calls(capfd.readouterr().err, op.mpi[0])
        assert len(calls) == 2, calls  # float32 and int32
        assert jax.tree.structure(out) == jax.tree.structure(tree)
        for got, expected, leaf in zip(
            jax.tree.leaves(out), jax.tree.leaves(want), jax.tree.leaves(tree)
        ):
            assert got.dtype == leaf.dtype and got.shape == expected.shape
            np.testing.assert_array_equal(np.asarray(got), expected)


@pytest.mark.mpi
def test_tiled_pytree_leaves_need_a_leading_axis(jc):
    with pytest.raises(ValueError, match="leading axis"):
        jc.allgather({"a": jnp.ones(2), "s": jnp.asarray(1.0)}, tiled=True)


@pytest.mark.mpi
@pytest.mark.parametrize("tiled", [False, True])
def test_gathered_pytree_with_empty_trailing_dimension(jc, tiled):
    # Found by tests/test_random_programs.py: tiled=True raised ZeroDivisionError.
    tree = {"empty": jnp.zeros((1, 0)), "b": jnp.arange(2.0) + jc.rank}
    stacked = np.stack([np.arange(2.0) + r for r in range(jc.size)])
    want_b = stacked.reshape(-1) if tiled else stacked
    want_empty = (jc.size, 0) if tiled else (jc.size, 1, 0)
    allgathered = jc.allgather(tree, tiled=tiled)
    gathered = jc.gather(tree, root=0, tiled=tiled)
    assert allgathered["empty"].shape == gathered["empty"].shape == want_empty
    np.testing.assert_array_equal(allgathered["b"], want_b)
    np.testing.assert_array_equal(gathered["b"], want_b if jc.rank == 0 else np.zeros_like(want_b))
