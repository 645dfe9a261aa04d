"""Data-parallel training: each rank differentiates its shard, allreduce sums.

Run:  mpiexec -n 4 python examples/data_parallel.py

A small two-layer network is fitted to a fixed regression data set. Each rank
holds a slice of the batch, computes the gradient of its share of the loss
(the sum of its samples' losses divided by the global batch size) and
`jc.allreduce` sums the gradient pytree in one MPI call. The sum is exactly the
full-batch gradient, so the run matches single-process training on the whole
batch; rank 0 prints the final loss and the largest parameter difference.
"""

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm import JaxComm

STEPS, LEARNING_RATE, BATCH, HIDDEN = 100, 0.1, 96, 16

jc = JaxComm()


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, 3)).astype(np.float32)
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


def sgd(params, grads):
    return jax.tree_util.tree_map(lambda p, g: p - LEARNING_RATE * g, params, grads)


@jax.jit
def parallel_step(params, x_shard, y_shard):
    grads = jax.grad(summed_loss)(params, x_shard, y_shard)
    grads = jc.allreduce(jax.tree_util.tree_map(lambda g: g / BATCH, grads))
    return sgd(params, grads)


@jax.jit
def serial_step(params, x, y):
    return sgd(params, jax.grad(lambda p: summed_loss(p, x, y) / BATCH)(params))


x, y = data()
mine = slice(jc.rank * BATCH // jc.size, (jc.rank + 1) * BATCH // jc.size)
parallel = serial = jax.tree_util.tree_map(jnp.asarray, init())
for _ in range(STEPS):
    parallel = parallel_step(parallel, x[mine], y[mine])
    serial = serial_step(serial, x, y)

difference = max(
    float(jnp.max(jnp.abs(a - b)))
    for a, b in zip(jax.tree_util.tree_leaves(parallel), jax.tree_util.tree_leaves(serial))
)
if jc.rank == 0:
    loss = float(summed_loss(parallel, x, y)) / BATCH
    print(f"{jc.size} ranks, {STEPS} steps: loss {loss:.4f}, "
          f"max difference from single-process training {difference:.1e}")
jc.free()
