"""Dispatch-ahead ordering stress: many jitted sends and receives queued before any completes.

Each rank sends a numbered stream of messages to the next rank of a ring and
receives the previous rank's stream, through a random mix of jitted
computations (a slow one that sends after a large matrix product, a quick
one, one sending three times from a ``fori_loop``, eager calls), without
waiting for any of them. MPI keeps the messages of one sender and tag in the
order they were sent, so the receiver gets the numbers in order exactly when
every rank ran its MPI calls in program order.

``python dispatch_ahead.py`` (under ``mpiexec -n 2``) is the negative
control: the same program with each rank's sends spread over two devices of
its process, with nothing ordering the devices' computations, must be seen
out of order.
"""

SENDS = 120
TAG = 7


def dispatch_ahead(jc, seed, devices=None):
    """Run the stress on ``jc`` and return the numbers received, in order of receipt.

    Args:
        jc: the JaxComm to communicate on.
        seed: picks the mix of computations (the same on every rank).
        devices: devices to spread the sends over, in turn; default: JAX's
            default device.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    dest, source = (jc.rank + 1) % jc.size, (jc.rank - 1) % jc.size
    rng = np.random.default_rng(seed)
    matrix = jnp.ones((384, 384), jnp.float32)

    def after_product(s, m):
        total = jnp.sin(m @ m @ m).sum()
        # Never true, but XLA cannot know that: the send waits for the product.
        return jc.send(jnp.where(jnp.isnan(total), -1, s), dest, tag=TAG)

    def three(s):
        return jax.lax.fori_loop(0, 3, lambda i, c: (jc.send(s + i, dest, tag=TAG), c)[1], 0)

    senders = {
        "slow": (jax.jit(after_product), 1),
        "quick": (jax.jit(lambda s: jc.send(s, dest, tag=TAG)), 1),
        "loop": (jax.jit(three), 3),
        "eager": (lambda s: jc.send(s, dest, tag=TAG), 1),
    }
    template = jnp.zeros((), jnp.int32)
    receive_one = jax.jit(lambda t: jc.recv(t, source, tag=TAG))
    receive_three = jax.jit(
        lambda t: jax.lax.fori_loop(
            0, 3, lambda i, acc: acc.at[i].set(jc.recv(t, source, tag=TAG)), jnp.zeros(3, t.dtype)
        )
    )

    devices = devices or [None]
    received = []
    sent = got = turn = 0
    while sent < SENDS:
        kind = rng.choice(list(senders))
        send, count = senders[kind]
        device = devices[turn % len(devices)]
        turn += 1
        number = jax.device_put(jnp.int32(sent), device)
        if kind == "slow":
            send(number, jax.device_put(matrix, device))
        else:
            send(number)
        sent += count
        # Receives are queued as we go, several sends behind.
        while got + 3 <= sent - 6:
            if rng.random() < 0.5:
                received.append(receive_three(template))
                got += 3
            else:
                received.append(receive_one(template))
                got += 1
    while got < sent:
        received.append(receive_one(template))
        got += 1
    return [int(v) for r in received for v in np.ravel(np.asarray(r))]


def out_of_order(numbers):
    """How many received numbers are not the next one expected."""
    return sum(1 for expected, got in enumerate(numbers) if got != expected)


if __name__ == "__main__":
    import os

    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax
    from mpi4py import MPI

    from jaxcomm import JaxComm, _compat

    _compat.fast_dispatch_any_device = True
    jc = JaxComm(MPI.COMM_WORLD)
    numbers = dispatch_ahead(jc, seed=1, devices=jax.local_devices())
    print(f"r{jc.rank} out of order {out_of_order(numbers)} of {len(numbers)}")
