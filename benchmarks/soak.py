"""Soak: many small jaxcomm calls of every kind, checked, and resident memory before and after.

Run:  mpiexec -n 2 python -m benchmarks.soak [--ops N] [--max-growth-mib M]

Cycles through rounds of small operations: eager and jitted calls,
collectives of every family, pytrees, ``vmap``, ``lax.scan`` and ``grad``,
a sendrecv ring and send/recv pairs with and without ``MPI.Status`` objects,
``return_status``, barriers and ``jaxcomm.sync()``. Every ``--check-every``
rounds each result is compared with its expected value computed with NumPy;
a mismatch stops every rank with exit status 2.

Resident memory (VmRSS) is measured after a warm-up that compiles
everything, and again at the end. The script prints, per rank and as the
maximum over ranks, the start, end and growth, and exits with status 1 when
the largest growth exceeds ``--max-growth-mib``.
"""

import argparse
import gc
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from mpi4py import MPI

from jaxcomm import JaxComm, sync

from .memory import rss_mib


def data(i, r, shape, dtype=np.float32):
    """Rank ``r``'s input for round ``i``: small integers, exact in every dtype used."""
    n = math.prod(shape)
    return ((np.arange(n) + 3 * r + i) % 7).astype(dtype).reshape(shape)


def zeros_unless(condition, value):
    """``value``, or zeros of its shape where ``condition`` is false (non-root outputs)."""
    return value if condition else np.zeros_like(value)


def build_steps(jc):
    """The operations of one round, as ``(name, run, expected)``.

    ``run(i)`` makes the call for round ``i`` and returns its result (a pytree
    of arrays, or a pair of a result and a check of an ``MPI.Status``);
    ``expected(i)`` computes the same result with NumPy from every rank's
    inputs.
    """
    rank, size = jc.rank, jc.size
    left, right = (rank - 1) % size, (rank + 1) % size
    # Pairs (0, 1), (2, 3), ...; an odd rank count leaves the last rank out.
    partner = rank ^ 1 if (rank ^ 1) < size else MPI.PROC_NULL
    counts = [r % 2 + 1 for r in range(size)]
    steps = []

    def every(i, shape, dtype=np.float32):
        """Every rank's input for round ``i``, in rank order."""
        return [data(i, r, shape, dtype) for r in range(size)]

    def step(name):
        """Register the ``(run, expected)`` pair that the decorated function returns."""

        def register(make):
            steps.append((name, *make()))

        return register

    @step("allreduce eager")
    def _():
        return (
            lambda i: jc.allreduce(jnp.asarray(data(i, rank, (8,)))),
            lambda i: sum(every(i, (8,))),
        )

    allreduce_max = jax.jit(lambda x: jc.allreduce(x, op=MPI.MAX))

    @step("allreduce jit MAX int32")
    def _():
        return (
            lambda i: allreduce_max(data(i, rank, (3, 2), np.int32)),
            lambda i: np.maximum.reduce(every(i, (3, 2), np.int32)),
        )

    @step("allreduce pytree eager")
    def _():
        def run(i):
            return jc.allreduce({"w": data(i, rank, (3, 2)), "b": data(i, rank, (), np.int32)})

        def expected(i):
            return {"w": sum(every(i, (3, 2))), "b": sum(every(i, (), np.int32))}

        return run, expected

    bcast_tree = jax.jit(jc.bcast, static_argnums=1)

    @step("bcast pytree jit")
    def _():
        def run(i):
            return bcast_tree((data(i, rank, (5,)), data(i, rank, (2,), np.int32)), i % size)

        def expected(i):
            root = i % size
            return (data(i, root, (5,)), data(i, root, (2,), np.int32))

        return run, expected

    @step("allgather pytree eager")
    def _():
        def run(i):
            return jc.allgather({"a": data(i, rank, (2,)), "b": data(i, rank, (), np.int32)})

        def expected(i):
            return {"a": np.stack(every(i, (2,))), "b": np.stack(every(i, (), np.int32))}

        return run, expected

    reduce_jit = jax.jit(lambda x, root: jc.reduce(x, root=root), static_argnums=1)

    @step("reduce jit")
    def _():
        return (
            lambda i: reduce_jit(data(i, rank, (4,)), i % size),
            lambda i: zeros_unless(rank == i % size, sum(every(i, (4,)))),
        )

    @step("scan eager")
    def _():
        return (
            lambda i: jc.scan(data(i, rank, (3,), np.int32)),
            lambda i: sum(every(i, (3,), np.int32)[: rank + 1]),
        )

    exscan_jit = jax.jit(lambda x: jc.exscan(x, op=MPI.PROD))

    @step("exscan jit PROD")
    def _():
        def expected(i):
            below = every(i, (3,))[:rank]
            return np.prod(below, axis=0) if below else np.zeros(3, np.float32)

        return lambda i: exscan_jit(data(i, rank, (3,))), expected

    reduce_scatter_jit = jax.jit(lambda x: jc.reduce_scatter(x, tiled=True))

    @step("reduce_scatter tiled jit")
    def _():
        return (
            lambda i: reduce_scatter_jit(data(i, rank, (2 * size, 2))),
            lambda i: sum(every(i, (2 * size, 2)))[2 * rank : 2 * rank + 2],
        )

    @step("gather eager")
    def _():
        return (
            lambda i: jc.gather(data(i, rank, (2,)), root=i % size),
            lambda i: zeros_unless(rank == i % size, np.stack(every(i, (2,)))),
        )

    scatter_jit = jax.jit(jc.scatter, static_argnums=1)

    @step("scatter jit")
    def _():
        return (
            lambda i: scatter_jit(data(i, rank, (size, 3)), i % size),
            lambda i: data(i, i % size, (size, 3))[rank],
        )

    @step("alltoall eager")
    def _():
        return (
            lambda i: jc.alltoall(data(i, rank, (size, 2), np.int32)),
            lambda i: np.stack([x[rank] for x in every(i, (size, 2), np.int32)]),
        )

    allgatherv_jit = jax.jit(lambda x: jc.allgatherv(x, counts))

    @step("allgatherv jit")
    def _():
        def run(i):
            return allgatherv_jit(data(i, rank, (counts[rank], 2)))

        def expected(i):
            return np.concatenate([data(i, r, (counts[r], 2)) for r in range(size)])

        return run, expected

    # Each tag is a program of its own: the warm-up compiles all of them.
    tags = 5

    @step("sendrecv eager with status")
    def _():
        def run(i):
            status = MPI.Status()
            y = jc.sendrecv(
                data(i, rank, (4,)),
                data(i, rank, (4,)),
                source=left,
                dest=right,
                sendtag=i % tags,
                status=status,
            )
            return y, [status.Get_source(), status.Get_tag(), status.Get_count(MPI.FLOAT)]

        return run, lambda i: (data(i, left, (4,)), [left, i % tags, 4])

    sendrecv_jit = jax.jit(
        lambda x: jc.sendrecv(x, x, source=left, dest=right, sendtag=3, return_status=True)
    )

    @step("sendrecv jit return_status")
    def _():
        return (
            lambda i: sendrecv_jit(data(i, rank, (2, 2), np.int32)),
            lambda i: (data(i, left, (2, 2), np.int32), np.array([left, 3, 4])),
        )

    @step("send/recv pair eager with status")
    def _():
        def run(i):
            x, status = data(i, rank, (3,)), MPI.Status()
            if rank % 2 == 0:
                jc.send(x, partner, tag=1)
                y = jc.recv(x, source=partner, tag=2, status=status)
            else:
                y = jc.recv(x, source=partner, tag=1, status=status)
                jc.send(x, partner, tag=2)
            return y, [status.Get_source(), status.Get_count(MPI.FLOAT)]

        def expected(i):
            if partner == MPI.PROC_NULL:
                return np.zeros(3, np.float32), [MPI.PROC_NULL, 0]
            return data(i, partner, (3,)), [partner, 3]

        return run, expected

    vmap_allreduce = jax.jit(jax.vmap(jc.allreduce))

    @step("vmap allreduce jit")
    def _():
        return (lambda i: vmap_allreduce(data(i, rank, (3, 4))), lambda i: sum(every(i, (3, 4))))

    ring = jax.vmap(lambda x: jc.sendrecv(x, x, source=left, dest=right))

    @step("vmap sendrecv eager")
    def _():
        return (lambda i: ring(jnp.asarray(data(i, rank, (2, 3)))), lambda i: data(i, left, (2, 3)))

    @jax.jit
    def running_sum(xs):
        return lax.scan(lambda c, x: (c + jc.allreduce(x), None), jnp.zeros(xs.shape[1:]), xs)[0]

    @step("lax.scan of allreduce jit")
    def _():
        return (
            lambda i: running_sum(data(i, rank, (4, 2))),
            lambda i: sum(every(i, (4, 2))).sum(axis=0),
        )

    # The cotangent of sendrecv's output goes back to the rank that sent it.
    weights = jnp.full(5, rank + 1.0)
    ring_grad = jax.jit(
        jax.grad(lambda x: jnp.sum(weights * jc.sendrecv(x, x, source=left, dest=right)))
    )

    @step("grad of sendrecv jit")
    def _():
        return (
            lambda i: ring_grad(data(i, rank, (5,))),
            lambda i: np.full(5, right + 1.0, np.float32),
        )

    @step("barrier eager")
    def _():
        return lambda i: jc.barrier(), lambda i: None

    @step("sync")
    def _():
        return lambda i: sync(), lambda i: None

    return steps


def mismatch(result, expected):
    """A description of how ``result`` differs from ``expected``, or None."""
    got, want = jax.tree_util.tree_leaves(result), jax.tree_util.tree_leaves(expected)
    if len(got) != len(want):
        return f"{len(got)} leaves, expected {len(want)}"
    for g, w in zip(got, want):
        g, w = np.asarray(g), np.asarray(w)
        if g.shape != w.shape or not np.array_equal(g, w):
            return f"got {g!r}, expected {w!r}"
    return None


def run_rounds(steps, first, last, check_every, ref):
    """Run rounds ``first..last-1``, checking each result in every ``check_every``-th round.

    Returns the number of calls made. Every rank exits with status 2 after a
    check round in which any rank saw a wrong result.
    """
    calls = 0
    for i in range(first, last):
        check = i % check_every == 0
        failures = []
        for name, run, expected in steps:
            result = run(i)
            calls += 1
            if check:
                problem = mismatch(result, expected(i))
                if problem:
                    failures.append(f"round {i}, {name}: {problem}")
        if check:
            for line in failures:
                print(f"r{ref.rank} | WRONG RESULT {line}", file=sys.stderr, flush=True)
            if ref.allreduce(bool(failures), op=MPI.LOR):
                sys.exit(2)
    return calls


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--ops",
        type=int,
        default=100_000,
        help="jaxcomm operations to run after the warm-up (default 100000)",
    )
    parser.add_argument(
        "--max-growth-mib",
        type=float,
        default=5.0,
        help="exit with status 1 if resident memory grows more (default 5)",
    )
    parser.add_argument(
        "--warmup-rounds",
        type=int,
        default=20,
        help="rounds run before the first measurement (default 20)",
    )
    parser.add_argument(
        "--check-every",
        type=int,
        default=7,
        help="check every result of every N-th round (default 7: a prime, so "
        "checked rounds cycle through every root and tag)",
    )
    args = parser.parse_args()

    ref = MPI.COMM_WORLD.Dup()
    jc = JaxComm(MPI.COMM_WORLD)
    steps = build_steps(jc)
    rounds = max(1, -(-args.ops // len(steps)))

    # The warm-up compiles everything and checks every one of its rounds.
    run_rounds(steps, 0, args.warmup_rounds, 1, ref)
    sync()
    gc.collect()
    start = rss_mib()

    ref.Barrier()
    began = time.perf_counter()
    first = args.warmup_rounds
    calls = run_rounds(steps, first, first + rounds, args.check_every, ref)
    sync()
    elapsed = time.perf_counter() - began
    gc.collect()
    end = rss_mib()

    figures = ref.allgather((start, end, elapsed))
    growth = max(e - s for s, e, _ in figures)
    if ref.rank == 0:
        print(
            f"{ref.size} rank(s), jax {jax.__version__}, {len(steps)} operations per round, "
            f"{args.warmup_rounds} warm-up rounds"
        )
        print(f"{calls} operations in {rounds} rounds, checked every {args.check_every}th round")
        for r, (s, e, t) in enumerate(figures):
            print(
                f"rank {r}: {t:7.1f} s ({t / calls * 1e6:6.1f} us/op), "
                f"RSS {s:8.1f} -> {e:8.1f} MiB, growth {e - s:+6.2f} MiB"
            )
        verdict = "OK" if growth <= args.max_growth_mib else "TOO MUCH"
        print(f"largest growth {growth:+.2f} MiB (limit {args.max_growth_mib} MiB): {verdict}")
    jc.free()
    ref.Free()
    if growth > args.max_growth_mib:
        sys.exit(1)


if __name__ == "__main__":
    main()
