"""Pipelined collectives: messages of two pieces or more go to MPI piece by piece.

A piece of a few bytes (set_pipeline_bytes) makes small arrays take the
pipelined path: one MPI call per piece on every platform, and on GPU arrays
staged piece by piece (tests/gpu and the emulated CUDA runtime run this file
through the CUDA platform layer).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import mpi_debug, rank_data, run_job, spawns_own_mpi, unchanged

import jaxcomm

PIECE = 24  # bytes: 6 float32, 3 float64, 24 int8, 1.5 complex128 (so 1)
DEFAULT = 4 << 20

# Below two pieces of float32 (11), exactly two (12), a short last piece (13),
# many pieces (50).
SIZES = [11, 12, 13, 50]
DTYPES = ["float32", "float64", "int8", "complex128", "bfloat16"]


@pytest.fixture
def pipelined():
    previous = jaxcomm.pipeline_bytes()
    jaxcomm.set_pipeline_bytes(PIECE)
    try:
        yield PIECE
    finally:
        jaxcomm.set_pipeline_bytes(previous)


# How a test calls the op: eagerly; jitted on an argument the caller keeps (the
# in-place ops then write an output of their own); jitted on a value computed
# inside (their output takes the input's buffer, and MPI works in place).
MODES = {
    "eager": lambda f: f,
    "jit": jax.jit,
    "in place": lambda f: jax.jit(lambda v: f(v + 0)),
}


def _together(mode, fs):
    """``fs`` applied to one input, one after another, called as ``mode`` calls one op."""
    return MODES[mode](lambda v: [f(v) for f in fs])


def _dtype(name):
    return np.dtype(jnp.bfloat16) if name == "bfloat16" else np.dtype(name)


def _sum(arrays, n, dtype):
    return functools.reduce(np.add, arrays, np.zeros(n, dtype))


def _data(size, n, dtype):
    # Small values: sums of every rank's stay exact in int8 and bfloat16.
    return [rank_data(r, (n,), dtype, high=3) for r in range(size)]


@pytest.mark.mpi
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reductions(jc, pipelined, dtype, n, mode):
    dtype = _dtype(dtype)
    rank, size = jc.rank, jc.size
    every = _data(size, n, dtype)
    x = jnp.asarray(every[rank])
    root = size - 1
    # Every call on every rank first: an assertion failing on one rank only
    # must not leave the others waiting in the next call.
    # Jitted, the four calls are one compiled program: one compile, not four.
    fs = (jc.allreduce, jc.scan, jc.exscan, lambda v: jc.reduce(v, root=root))
    got = [np.asarray(y) for y in _together(mode, fs)(x)]
    total = _sum(every, n, dtype)
    reduced = total if rank == root else np.zeros(n, dtype)
    wants = [total, _sum(every[: rank + 1], n, dtype), _sum(every[:rank], n, dtype), reduced]
    for result, want in zip(got, wants):
        np.testing.assert_array_equal(result, want)
    unchanged(x, every[rank])


@pytest.mark.mpi
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", ["float32", "int8", "complex128"])
def test_bcast_and_allgather(jc, pipelined, dtype, n, mode):
    dtype = np.dtype(dtype)
    rank, size = jc.rank, jc.size
    every = _data(size, n, dtype)
    x = jnp.asarray(every[rank])
    # Jitted, every call is in one compiled program: one compile, not size + 2.
    fs = [lambda v, root=root: jc.bcast(v, root=root) for root in range(size)]
    fs += [jc.allgather, lambda v: jc.allgather(v.reshape(n, 1), tiled=True)]
    *sent, stacked, tiled = (np.asarray(y) for y in _together(mode, fs)(x))
    for root in range(size):
        np.testing.assert_array_equal(sent[root], every[root])
    np.testing.assert_array_equal(stacked, np.stack(every))
    np.testing.assert_array_equal(tiled, np.concatenate(every).reshape(size * n, 1))
    unchanged(x, every[rank])


@pytest.mark.mpi
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", ["float32", "int8", "complex128"])
def test_nonblocking_reductions_and_bcast(jc, pipelined, dtype, n, mode):
    # The starts make one MPI call per piece, and the wait completes the
    # pieces in order and moves each to the output (on a GPU, as it completes).
    dtype = _dtype(dtype)
    rank, size = jc.rank, jc.size
    every = _data(size, n, dtype)
    x = jnp.asarray(every[rank])
    root = size - 1

    def run(v):
        return jc.waitall(
            [jc.iallreduce(v), jc.ireduce(v, root=root), jc.iscan(v), jc.ibcast(v, root=root)]
        )

    total, reduced, scanned, sent = MODES[mode](run)(x)
    np.testing.assert_array_equal(np.asarray(total), _sum(every, n, dtype))
    want = _sum(every, n, dtype) if rank == root else np.zeros(n, dtype)
    np.testing.assert_array_equal(np.asarray(reduced), want)
    np.testing.assert_array_equal(np.asarray(scanned), _sum(every[: rank + 1], n, dtype))
    np.testing.assert_array_equal(np.asarray(sent), every[root])
    unchanged(x, every[rank])


@pytest.mark.mpi
def test_nonblocking_work_between_start_and_wait(jc, pipelined):
    # The input is computed just before the start and the output used just
    # after the wait, with computation on other values in between.
    size = jc.size
    every = _data(size, 50, np.float32)
    x = jnp.asarray(every[jc.rank])

    @jax.jit
    def run(v):
        request = jc.iallreduce(v * 2)
        other = jnp.sin(v) * 3
        return jc.wait(request) + 1, other

    total, other = run(x)
    np.testing.assert_array_equal(np.asarray(total), _sum(every, 50, np.float32) * 2 + 1)
    np.testing.assert_allclose(np.asarray(other), np.sin(every[jc.rank]) * 3, rtol=1e-6)


@pytest.mark.mpi
def test_in_a_loop_the_carry_is_reduced_in_place(jc, pipelined):
    # The loop's carry is aliased to the result: the pieces are read from and
    # written back to the same buffer, and each step starts from the last.
    size = jc.size
    x = jnp.asarray(rank_data(jc.rank, (50,), np.float32, high=3))

    @jax.jit
    def steps(v):
        return jax.lax.fori_loop(0, 3, lambda _, w: jc.allreduce(w) - w * (size - 1), v)

    want = np.asarray(x)
    every = _data(size, 50, np.float32)
    for _ in range(3):
        total = _sum(every, 50, np.float32)
        every = [total - e * (size - 1) for e in every]
        want = every[jc.rank]
    np.testing.assert_array_equal(np.asarray(steps(x)), want)


@pytest.mark.mpi
def test_one_mpi_call_per_piece(jc, pipelined, capfd):
    with mpi_debug():
        jc.allreduce(jnp.ones(50, jnp.float32)).block_until_ready()
        jc.bcast(jnp.ones(13, jnp.float32), root=0).block_until_ready()
        jc.allgather(jnp.ones(12, jnp.float32)).block_until_ready()
        jc.allreduce(jnp.ones(11, jnp.float32)).block_until_ready()
        jc.reduce(jnp.ones(13, jnp.float32), root=0).block_until_ready()
    lines = [line.split(" | ")[1] for line in capfd.readouterr().err.splitlines() if " | " in line]
    assert lines == (
        ["MPI_Allreduce op SUM count 6 float32"] * 8
        + ["MPI_Allreduce op SUM count 2 float32"]
        + ["MPI_Bcast root 0 count 6 float32"] * 2
        + ["MPI_Bcast root 0 count 1 float32"]
        + ["MPI_Allgather count 6 float32"] * 2
        + ["MPI_Allreduce op SUM count 11 float32"]
        + ["MPI_Reduce op SUM root 0 count 6 float32"] * 2
        + ["MPI_Reduce op SUM root 0 count 1 float32"]
    )


@pytest.mark.mpi
def test_one_nonblocking_mpi_call_per_piece(jc, pipelined, capfd):
    with mpi_debug():
        jc.wait(jc.iallreduce(jnp.ones(50, jnp.float32))).block_until_ready()
        jc.wait(jc.ibcast(jnp.ones(13, jnp.float32), root=0)).block_until_ready()
        jc.wait(jc.iscan(jnp.ones(11, jnp.float32))).block_until_ready()
    lines = [line.split(" | ")[1] for line in capfd.readouterr().err.splitlines() if " | " in line]
    calls = [line for line in lines if not line.startswith("MPI_Wait")]
    assert calls == (
        ["MPI_Iallreduce op SUM count 6 float32"] * 8
        + ["MPI_Iallreduce op SUM count 2 float32"]
        + ["MPI_Ibcast root 0 count 6 float32"] * 2
        + ["MPI_Ibcast root 0 count 1 float32"]
        + ["MPI_Iscan op SUM count 11 float32"]
    )
    # One wait per request, whatever its pieces.
    assert len(lines) - len(calls) == 3


@pytest.mark.mpi
def test_default_pieces_and_whole_messages_when_off(jc, capfd):
    # 4 MiB pieces by default: 8 MiB of float32 is two, just under it one.
    assert jaxcomm.pipeline_bytes() == DEFAULT
    with mpi_debug():
        jc.allreduce(jnp.ones(DEFAULT // 2, jnp.float32)).block_until_ready()
        jc.allreduce(jnp.ones(DEFAULT // 2 - 1, jnp.float32)).block_until_ready()
        jaxcomm.set_pipeline_bytes(0)
        try:
            jc.allreduce(jnp.ones(DEFAULT // 2, jnp.float32)).block_until_ready()
        finally:
            jaxcomm.set_pipeline_bytes(DEFAULT)
    lines = [line.split(" | ")[1] for line in capfd.readouterr().err.splitlines() if " | " in line]
    assert lines == [f"MPI_Allreduce op SUM count {DEFAULT // 4} float32"] * 2 + [
        f"MPI_Allreduce op SUM count {n} float32" for n in (DEFAULT // 2 - 1, DEFAULT // 2)
    ]


def test_setting_is_checked():
    with pytest.raises(TypeError, match="nbytes must be an integer"):
        jaxcomm.set_pipeline_bytes(1.5)
    with pytest.raises(TypeError, match="nbytes must be an integer"):
        jaxcomm.set_pipeline_bytes(True)
    with pytest.raises(ValueError, match="0 \\(off\\) or a positive number"):
        jaxcomm.set_pipeline_bytes(-1)
    assert jaxcomm.pipeline_bytes() == DEFAULT


@spawns_own_mpi
def test_environment_variable_sets_it_at_import(tmp_path):
    done, _ = run_job(
        tmp_path,
        """
        import jaxcomm
        print(jaxcomm.pipeline_bytes())
        """,
        ranks=1,
        JAXCOMM_PIPELINE_BYTES="4096",
    )
    assert done.stdout.split() == ["4096"], done.stderr
    done, _ = run_job(tmp_path, "import jaxcomm", ranks=1, JAXCOMM_PIPELINE_BYTES="4 MiB")
    assert done.returncode != 0
    assert "JAXCOMM_PIPELINE_BYTES must be a whole number of bytes, got '4 MiB'" in done.stderr
