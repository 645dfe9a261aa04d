"""Data-parallel training: each rank differentiates its shard, allreduce sums.

Run:  mpiexec -n 4 python examples/data_parallel.py [--epochs 10]

A small two-layer network is fitted to a fixed regression data set by
minibatch gradient descent: each epoch visits every sample once, in batches
of ``--batch-size`` samples drawn in an order that every rank shuffles alike.
Each rank holds a slice of every batch, computes the gradient of its share of
the loss (the sum of its samples' losses divided by the batch size) and
``jc.allreduce`` sums the gradient pytree in one MPI call. The sum is exactly
the gradient of the whole batch, so the run matches single-process training,
which every rank also runs, step by step, on whole batches.

Rank 0 prints, after each epoch, the loss on the whole data set (each rank
evaluates its share, an allreduce adds them) next to the single-process loss;
then the final loss and the largest parameter difference from single-process
training, in the line ``4 ranks, 100 steps: loss ..., max difference from
single-process training ...`` (about 1e-7 in float32).
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm import JaxComm

HIDDEN = 16


def parse_args():
    parser = argparse.ArgumentParser(
        description="Data-parallel training with an allreduce of gradients (see the docstring)."
    )
    parser.add_argument("--epochs", type=int, default=10, help="passes over the data (default 10)")
    parser.add_argument("--batches", type=int, default=10, help="batches per epoch (default 10)")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=96,
        help="samples per batch, split over the ranks (default 96)",
    )
    parser.add_argument("--learning-rate", type=float, default=0.1, help="(default 0.1)")
    args = parser.parse_args()
    if min(args.epochs, args.batches, args.batch_size) < 1 or args.learning_rate <= 0:
        parser.error("--epochs, --batches and --batch-size must be >= 1, --learning-rate > 0")
    return args


def data(samples):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, 3)).astype(np.float32)
    y = np.sin(x @ np.array([1.0, -2.0, 0.5], np.float32))[:, None]
    return x, y


def init():
    rng = np.random.default_rng(1)
    return {
        "hidden": {"w": rng.normal(size=(3, HIDDEN)) * 0.5, "b": np.zeros(HIDDEN)},
        "out": {"w": rng.normal(size=(HIDDEN, 1)) * 0.5, "b": np.zeros(1)},
    }


def summed_loss(params, x, y):
    h = jnp.tanh(x @ params["hidden"]["w"] + params["hidden"]["b"])
    prediction = h @ params["out"]["w"] + params["out"]["b"]
    return jnp.sum((prediction - y) ** 2)


def main():
    args = parse_args()
    jc = JaxComm()
    batch, samples = args.batch_size, args.batch_size * args.batches

    def sgd(params, grads):
        return jax.tree_util.tree_map(lambda p, g: p - args.learning_rate * g, params, grads)

    @jax.jit
    def parallel_step(params, x_shard, y_shard):
        grads = jax.grad(summed_loss)(params, x_shard, y_shard)
        grads = jc.allreduce(jax.tree_util.tree_map(lambda g: g / batch, grads))
        return sgd(params, grads)

    @jax.jit
    def serial_step(params, x, y):
        return sgd(params, jax.grad(lambda p: summed_loss(p, x, y) / batch)(params))

    @jax.jit
    def parallel_loss(params, x_shard, y_shard):
        return jc.allreduce(summed_loss(params, x_shard, y_shard)) / samples

    def share(n):
        """This rank's slice of n items: contiguous, sizes differing by at most one."""
        return slice(jc.rank * n // jc.size, (jc.rank + 1) * n // jc.size)

    x, y = data(samples)
    parallel = serial = jax.tree_util.tree_map(jnp.asarray, init())
    for epoch in range(args.epochs):
        order = np.random.default_rng(100 + epoch).permutation(samples)
        for b in range(args.batches):
            chosen = order[b * batch : (b + 1) * batch]
            mine = chosen[share(batch)]
            parallel = parallel_step(parallel, x[mine], y[mine])
            serial = serial_step(serial, x[chosen], y[chosen])
        loss = float(parallel_loss(parallel, x[share(samples)], y[share(samples)]))
        serial_loss = float(summed_loss(serial, x, y)) / samples
        if jc.rank == 0:
            print(
                f"epoch {epoch + 1}/{args.epochs}: loss {loss:.4f}, "
                f"single process {serial_loss:.4f}"
            )

    difference = max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(jax.tree_util.tree_leaves(parallel), jax.tree_util.tree_leaves(serial))
    )
    if jc.rank == 0:
        print(
            f"{jc.size} ranks, {args.epochs * args.batches} steps: loss {loss:.4f} "
            f"(single process {serial_loss:.4f}), "
            f"max difference from single-process training {difference:.1e}"
        )
    jc.free()


if __name__ == "__main__":
    main()
