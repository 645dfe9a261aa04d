"""The collective mismatch checker (jaxcomm.set_check, JAXCOMM_CHECK).

Each mismatch test has rank 0 call one thing and the other ranks another,
and checks that every rank raises the same error, naming both calls and
their lines in this file, instead of hanging or corrupting data, and that
the communicator works normally afterwards. Every row of ``operations.py``
gives its table result with the checker on.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import RUNTIME_ERRORS, X64, not_reported_again, rank_data
from mpi4py import MPI
from operations import BY_ID, JIT, params, select

import jaxcomm

FLOAT = jnp.float64 if X64 else jnp.float32
INT = jnp.int32
THIS_FILE = re.escape(__file__.rstrip("c"))


@pytest.fixture
def checked(jc):
    jaxcomm.set_check(True)
    yield jc
    jaxcomm.set_check(False)


def _data(op, size):
    return lambda r: rank_data(r, op.shape(size, r), np.dtype(FLOAT))


def _gives_its_result(jc, op, call):
    """``call(x)`` gives the table's result for ``op`` on this rank."""
    data = _data(op, jc.size)
    got = jax.block_until_ready(call(jnp.asarray(data(jc.rank))))
    jaxcomm.sync()
    np.testing.assert_array_equal(np.asarray(got), op.expected(data, jc.rank, jc.size))


def _still_works(jc):
    op = BY_ID["allreduce"]
    _gives_its_result(jc, op, lambda x: op.call(jc, x))


def _run(mode, call, x):
    """``call(x)`` eagerly, jitted, or as the body of a jitted three-step loop."""
    if mode == "eager":
        return jax.block_until_ready(call(x))
    if mode == "jit":
        return jax.block_until_ready(jax.jit(call)(x))
    return jax.block_until_ready(
        jax.jit(lambda x: jax.lax.fori_loop(0, 3, lambda i, c: call(c), x))(x)
    )


def _expect_mismatch(jc, kind, run, *patterns):
    """Run ``run()`` then ``jaxcomm.sync()``; one of them must raise a ``kind`` mismatch."""
    # JAX raises the failure of a computation with outputs; sync() raises
    # that of one without (a send), which JAX drops.
    with pytest.raises((*RUNTIME_ERRORS, RuntimeError), match=f"{kind} mismatch") as raised:
        run()
        jaxcomm.sync()
    message = str(raised.value)
    for pattern in patterns:
        assert re.search(pattern, message), (pattern, message)
    if not message.startswith("an MPI call jaxcomm dispatched earlier failed"):
        not_reported_again()
    return message


# (rank 0's call, the other ranks' call, patterns the message must hold).
# Every call maps x, 4 elements, to an array of x's shape and dtype, so that
# either can be a loop's body.
COLLECTIVES = {
    "operation": (
        lambda jc, x: jc.allreduce(x),
        lambda jc, x: jc.bcast(x, root=0),
        [r"rank 0 called allreduce\(op SUM, count 4 float", r"called bcast\(root 0, count 4"],
    ),
    "root": (
        lambda jc, x: jc.bcast(x, root=0),
        lambda jc, x: jc.bcast(x, root=1),
        [r"rank 0 called bcast\(root 0,", r"called bcast\(root 1,"],
    ),
    "reduction": (
        lambda jc, x: jc.allreduce(x, op=MPI.SUM),
        lambda jc, x: jc.allreduce(x, op=MPI.MAX),
        [r"allreduce\(op SUM", r"allreduce\(op MAX"],
    ),
    "count": (
        lambda jc, x: jc.allreduce(x),
        lambda jc, x: jnp.concatenate([jc.allreduce(x[:3]), x[3:]]),
        [r"count 4 float", r"count 3 float"],
    ),
    "dtype": (
        lambda jc, x: jc.allreduce(x),
        lambda jc, x: jc.allreduce(x.astype(INT)).astype(x.dtype),
        [r"count 4 float", r"count 4 int32"],
    ),
    "gather root": (
        lambda jc, x: jc.gather(x, root=0)[0],
        lambda jc, x: jc.gather(x, root=1)[0],
        [r"gather\(root 0", r"gather\(root 1"],
    ),
    "barrier": (
        lambda jc, x: jc.allreduce(x),
        lambda jc, x: (jc.barrier(), x)[1],
        [r"allreduce\(op SUM", r"called barrier\(\)"],
    ),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", ["eager", "jit", "loop"])
@pytest.mark.parametrize("kind", list(COLLECTIVES))
def test_collective_mismatch_raises_on_every_rank(checked, kind, mode):
    jc = checked
    first, others, patterns = COLLECTIVES[kind]
    call = first if jc.rank == 0 else others
    x = jnp.arange(4, dtype=FLOAT)
    message = _expect_mismatch(
        jc, "collective", lambda: _run(mode, lambda v: call(jc, v), x), *patterns
    )
    # Both call sites, lines of this file, and who this rank is.
    assert len(re.findall(THIS_FILE + r":\d+ \(<lambda>\)", message)) >= 2, message
    assert f"this is rank {jc.rank})" in message
    _still_works(jc)


@pytest.mark.mpi(min_size=2)
def test_v_counts_mismatch(checked):
    jc = checked
    counts = [1] * jc.size
    if jc.rank != 0:
        counts[0] = 2  # rank 0 sends one row; the others expect two
    x = jnp.ones((counts[jc.rank], 2), FLOAT)
    _expect_mismatch(
        jc,
        "collective",
        lambda: jax.block_until_ready(jc.allgatherv(x, counts)),
        r"allgatherv\(counts 1,1",
        r"allgatherv\(counts 2,1",
    )
    _still_works(jc)


@pytest.mark.mpi(min_size=2)
def test_mismatch_on_a_split_communicator_created_while_checking(checked):
    jc = checked
    sub = jc.split(color=0)
    try:
        x = jnp.ones(2, FLOAT)
        run = (lambda: sub.allreduce(x)) if sub.rank == 0 else (lambda: sub.bcast(x))
        _expect_mismatch(sub, "collective", lambda: jax.block_until_ready(run()))
        np.testing.assert_allclose(np.asarray(sub.allreduce(x)), sub.size)
    finally:
        sub.free()


@pytest.mark.mpi(min_size=2)
def test_eager_calls_report_their_own_lines(checked):
    jc = checked
    x = jnp.ones(4, FLOAT)
    # The same eager calls from two lines: each must name its own line.
    first = lambda: jc.allreduce(x) if jc.rank == 0 else jc.bcast(x)  # noqa: E731
    second = lambda: jc.allreduce(x) if jc.rank == 0 else jc.bcast(x)  # noqa: E731
    for call in (first, second):
        message = _expect_mismatch(jc, "collective", lambda: jax.block_until_ready(call()))
        line = call.__code__.co_firstlineno
        assert message.count(f"{__file__.rstrip('c')}:{line} (") == 2, message
    _still_works(jc)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize(
    "received, pattern",
    [
        (jnp.zeros(4, INT), r"sending count 4 float.*receiving up to count 4 int32"),
        (jnp.zeros(3, FLOAT), r"sending count 4 float.*receiving up to count 3 float"),
    ],
    ids=["dtype", "truncation"],
)
def test_point_to_point_mismatch_fails_on_the_receiver(checked, received, pattern, jit):
    jc = checked
    x = jnp.arange(4, dtype=FLOAT)

    def pair(x):
        if jc.rank == 0:
            jc.send(x, dest=1, tag=5)
            return jnp.zeros(())
        if jc.rank == 1:
            return jc.recv(received, source=0, tag=5).sum().astype(jnp.zeros(()).dtype)
        return jnp.zeros(())

    run = jax.jit(pair) if jit else pair
    if jc.rank == 1:
        message = _expect_mismatch(
            jc, "point-to-point", lambda: jax.block_until_ready(run(x)), pattern
        )
        assert "rank 0 called send" in message and "rank 1 called recv" in message
        assert message.count(__file__.rstrip("c")) == 2, message
    else:
        # The sender's send completes; the receiver discarded the message.
        jax.block_until_ready(run(x))
        jaxcomm.sync()
    _still_works(jc)


@pytest.mark.mpi(min_size=2)
def test_messages_received_in_another_order_than_sent(checked):
    # Small sends complete before their receives are posted: the checker
    # must not make them wait (rank 1 takes tag 2 first).
    jc = checked

    def program(x):
        if jc.rank == 0:
            jc.send(x, dest=1, tag=1)
            jc.send(x + 1, dest=1, tag=2)
            return x, x
        if jc.rank == 1:
            second = jc.recv(x, source=0, tag=2)
            first = jc.recv(x, source=0, tag=1)
            return first, second
        return x, x

    first, second = jax.jit(program)(jnp.zeros(2, FLOAT))
    if jc.rank == 1:
        np.testing.assert_array_equal(np.asarray(first), [0, 0])
        np.testing.assert_array_equal(np.asarray(second), [1, 1])
    _still_works(jc)


@pytest.mark.mpi(min_size=2)
def test_a_shorter_message_is_no_mismatch(checked):
    jc = checked

    def pair(x):
        if jc.rank == 0:
            jc.send(x, dest=1)
        if jc.rank == 1:
            return jc.recv(jnp.ones(5, FLOAT), source=0, return_status=True)
        return x, jnp.zeros(3, INT)

    y, status = jax.jit(pair)(jnp.arange(3, dtype=FLOAT) + 1)
    if jc.rank == 1:
        np.testing.assert_array_equal(np.asarray(y), [1, 2, 3, 0, 0])
        assert int(status[2]) == 3
    _still_works(jc)


@pytest.mark.mpi(min_size=2)
def test_ring_with_one_bad_message(checked):
    # Rank 1 takes (and sends) 3 elements where rank 0 sends it 4; every
    # other message of the ring fits. Only rank 1 fails, and nobody waits.
    jc = checked
    dest, source = (jc.rank + 1) % jc.size, (jc.rank - 1) % jc.size
    x = jnp.arange(3 if jc.rank == 1 else 4, dtype=FLOAT) + jc.rank
    f = jax.jit(lambda x: jc.sendrecv(x, x, source=source, dest=dest))
    if jc.rank == 1:
        _expect_mismatch(
            jc,
            "point-to-point",
            lambda: jax.block_until_ready(f(x)),
            r"rank 0 called sendrecv sending count 4 float.*"
            r"rank 1 called sendrecv receiving up to count 3",
        )
    else:
        expected = np.arange(4) + source if source != 1 else np.r_[np.arange(3) + 1, 0]
        np.testing.assert_array_equal(np.asarray(f(x)), expected)
    _still_works(jc)


@pytest.mark.mpi(min_size=2)
def test_wildcard_receives_take_the_checked_message(checked):
    jc = checked
    n = jc.size - 1

    def program(x):
        if jc.rank == 0:
            got = []
            for _ in range(n):
                y, status = jc.recv(
                    jnp.zeros(2, FLOAT),
                    source=MPI.ANY_SOURCE,
                    tag=MPI.ANY_TAG,
                    return_status=True,
                )
                got.append((y, status))
            return got
        jc.send(x * jc.rank, dest=0, tag=jc.rank)
        return []

    results = jax.jit(program)(jnp.ones(2, FLOAT))
    if jc.rank == 0:
        seen = set()
        for y, status in results:
            source, tag, count = (int(v) for v in status)
            assert tag == source and count == 2
            np.testing.assert_array_equal(np.asarray(y), [source, source])
            seen.add(source)
        assert seen == set(range(1, jc.size))
    _still_works(jc)


@pytest.mark.mpi
def test_matching_programs_run_unchanged(checked):
    jc = checked
    x = jnp.arange(6, dtype=FLOAT).reshape(3, 2) + jc.rank

    def program(x):
        total = jc.allreduce(x)
        x = jc.bcast(x, root=jc.size - 1)
        gathered = jc.allgather(x)
        part = jc.reduce_scatter(jnp.broadcast_to(x, (jc.size, *x.shape)))
        left = jc.sendrecv(x, x, source=(jc.rank - 1) % jc.size, dest=(jc.rank + 1) % jc.size)
        jc.barrier()
        return total, gathered, part, left

    reference = jax.jit(program)(x)
    grads = jax.grad(lambda x: jc.allreduce(x).sum())(x)
    looped = jax.jit(jax.vmap(lambda v: jc.allreduce(v)))(x)
    jaxcomm.set_check(False)
    try:
        unchecked = jax.jit(program)(x)
    finally:
        jaxcomm.set_check(True)
    for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(unchecked)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(grads), np.ones((3, 2)))
    np.testing.assert_array_equal(np.asarray(looped), np.asarray(reference[0]))


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("op", params(select(JIT)))
def test_every_operation_gives_its_result_when_checked(checked, op, mode):
    jc = checked
    call = lambda x: op.call(jc, x)
    _gives_its_result(jc, op, call if mode == "eager" else jax.jit(call))


def test_set_check_switch_is_reported():
    from jaxcomm import _runtime

    before = _runtime.checking()
    jaxcomm.set_check(True)
    assert _runtime.checking()
    jaxcomm.set_check(False)
    assert not _runtime.checking()
    jaxcomm.set_check(before)
    with pytest.raises(TypeError, match="enabled must be a bool, got str"):
        jaxcomm.set_check("yes")
