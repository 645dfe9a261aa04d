"""jaxcomm inside multi-process shard_map programs (jax.distributed, one device per process).

jax.distributed must start before JAX's backends, which the test session
has already started: each case is an MPI job of its own. The job compares
jaxcomm's collectives on ``JaxComm.for_mesh`` communicators with JAX's own on
the same mesh axes, results and gradients, over a mesh whose device order is
not the processes' order, and checks the refusals.
"""

import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_job, spawns_own_mpi
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from mpi4py import MPI

import jaxcomm
from jaxcomm import JaxComm

_JOB = """
import sys

import jaxcomm
from mpi4py import MPI

jaxcomm.initialize_jax_distributed()

import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxcomm import JaxComm

world = MPI.COMM_WORLD
size = world.size
assert jax.process_count() == size and len(jax.local_devices()) == 1
rng = np.random.default_rng(7)
# Reversed and, on 4 processes, 2x2: mesh positions are not process indices.
devices = np.array(sorted(jax.devices(), key=lambda d: -d.process_index))
layouts = {"1d": Mesh(devices, ("x",))}
if size == 4:
    layouts["2d"] = Mesh(devices.reshape(2, 2), ("x", "y"))
ok = []


def check(label, a, b, rtol=1e-5):
    a = np.asarray(a.addressable_shards[0].data)
    b = np.asarray(b.addressable_shards[0].data)
    assert a.shape == b.shape and np.allclose(a, b, rtol=rtol, atol=1e-5), (label, a, b)


def ring(axes, mesh):
    n = int(np.prod([mesh.shape[a] for a in axes]))
    return n, [(i, (i + 1) % n) for i in range(n)]


def pairs(axes, jc, ring_jc, mesh):
    n, perm = ring(axes, mesh)
    r = ring_jc.rank
    psum = lambda v: jax.lax.psum(v, axes)
    gather = lambda v: jax.lax.all_gather(v, axes)
    # A broadcast from the last rank: JAX's all_gather keeps root's block.
    root = n - 1
    from_root = lambda v: gather(v)[root]
    return {
        "allreduce": (psum, jc.allreduce),
        "bcast": (from_root, lambda v: jc.bcast(v, root=root)),
        "ibcast": (from_root, lambda v: jc.wait(jc.ibcast(v, root=root))),
        "allgather": (gather, jc.allgather),
        "iallreduce": (psum, lambda v: jc.wait(jc.iallreduce(v))),
        "iallgather": (gather, lambda v: jc.wait(jc.iallgather(v))),
        "sendrecv": (
            lambda v: jax.lax.ppermute(v, ring_jc.mesh_axes, perm),
            lambda v: ring_jc.sendrecv(v, v, source=(r - 1) % n, dest=(r + 1) % n),
        ),
        "alltoall": (
            lambda v: jax.lax.all_to_all(v, axes, 0, 0, tiled=True),
            lambda v: jc.alltoall(v, tiled=True),
        ),
        "reduce_scatter": (
            lambda v: jax.lax.psum_scatter(v, axes, scatter_dimension=0, tiled=True),
            lambda v: jc.reduce_scatter(v, tiled=True),
        ),
    }


for layout, mesh in layouts.items():
    names = mesh.axis_names
    groups = [(a,) for a in names] + ([names, names[::-1]] if len(names) > 1 else [])
    every = P(names)  # each device's block along the leading axis
    for axes in groups:
        jc = JaxComm.for_mesh(mesh, axes)
        n, _ = ring(axes, mesh)
        assert jc.size == n and jc.mesh_axes == axes
        # The rank is the position along the axes, as JAX numbers it.
        sharding = NamedSharding(mesh, every)
        zeros = jax.make_array_from_callback((mesh.size,), sharding, lambda i: np.zeros(1)[:1])
        where = jax.jit(jax.shard_map(
            lambda v: jax.lax.axis_index(axes)[None] + 0 * v.astype(np.int32),
            mesh=mesh, in_specs=every, out_specs=every,
        ))(zeros)
        assert int(where.addressable_shards[0].data[0]) == jc.rank, (layout, axes)
        shape = (mesh.size * 2 * n, 3)
        data = rng.standard_normal(shape).astype(np.float32)
        weights = rng.standard_normal(shape).astype(np.float32)
        x = jax.make_array_from_callback(shape, sharding, lambda i: data[i])
        # ppermute takes several axes in the mesh's order only (jax 0.12
        # refuses others; earlier versions number positions in that order anyway).
        ring_jc = JaxComm.for_mesh(mesh, tuple(a for a in names if a in axes))
        # With check_vma off, JAX takes every value for a per-device one and
        # its collectives transpose exactly (psum to psum): so do jaxcomm's.
        ops = pairs(axes, jc, ring_jc, mesh)
        cases = [(op, check_vma) for op in ops for check_vma in (True, False)]
        runs = {}
        for name, side in (("jax", 0), ("jaxcomm", 1)):
            # Each case in a shard_map of its own, its result and gradient
            # apart; all of them in one program per side: a compile per side,
            # not two per case.
            maps, ws = [], []
            for op, check_vma in cases:
                f = jax.shard_map(
                    lambda v, fn=ops[op][side]: fn(v).reshape(-1, 3), mesh=mesh,
                    in_specs=every, out_specs=every, check_vma=check_vma,
                )
                w_shape = jax.eval_shape(f, x).shape
                maps.append(f)
                ws.append(jax.make_array_from_callback(
                    w_shape, NamedSharding(mesh, every),
                    lambda i, s=w_shape: np.resize(weights, s)[i],
                ))

            def every_case(v, ws, maps=maps):
                return [
                    (f(v), jax.grad(lambda u, w, f=f: jnp.sum(jnp.sin(f(u)) * w))(v, w))
                    for f, w in zip(maps, ws)
                ]

            runs[name] = jax.jit(every_case)(x, ws)
        for (op, check_vma), theirs, ours in zip(cases, runs["jax"], runs["jaxcomm"]):
            check((layout, axes, op, check_vma), theirs[0], ours[0])
            check((layout, axes, op, check_vma, "grad"), theirs[1], ours[1])
        ok.append(f"{layout} {axes}")
        jc.free()
        ring_jc.free()

# A replicated result leaves shard_map with out_specs P(), as psum's does, and
# differentiates as psum does, also of a value that does not vary; with
# check_vma off, shard_map divides its cotangent among the devices.
mesh = layouts["1d"]
jc = JaxComm.for_mesh(mesh, "x")
world_jc = JaxComm(world)
x = jax.make_array_from_callback(
    (size, 2), NamedSharding(mesh, P("x")), lambda i: np.arange(2.0 * size).reshape(size, 2)[i]
)
totals = {
    "jax": lambda v: jax.lax.psum(v, "x"),
    "for_mesh": jc.allreduce,
    "world": world_jc.allreduce,
    "nonblocking": lambda v: jc.wait(jc.iallreduce(v)),
}


def replicated(names):
    # Every case in a shard_map of its own, one program for all of them.
    maps = [
        jax.shard_map(
            lambda v, t=totals[name]: t(jnp.sum(v ** 2)) + t(jnp.float32(3.0)) * jnp.sum(t(v)),
            mesh=mesh, in_specs=P("x"), out_specs=P(), check_vma=check_vma,
        )
        for name in names
        for check_vma in (True, False)
    ]
    return jax.jit(lambda v: [(f(v), jax.grad(f)(v)) for f in maps])(x)


mapped = ["for_mesh", "world", "nonblocking"]
replicated_cases = [(name, check_vma) for name in mapped for check_vma in (True, False)]
expected = replicated(["jax"]) * len(mapped)
for (name, check_vma), (result, grad), want in zip(replicated_cases, replicated(mapped), expected):
    check((name, check_vma), result, want[0])
    check((name, check_vma, "grad"), grad, want[1])
ok.append("replicated")

# JAX's collectives and jaxcomm's calls that do not depend on each other, in
# one program, run back to back: XLA picks their order, the same program on
# every process, and they must meet without deadlock and add up right.
steps, n = 6, size
ids = np.arange(4.0 * size).reshape(size, 4)
state = jax.make_array_from_callback((size, 4), NamedSharding(mesh, P("x")), lambda i: ids[i])


def mixed(u):
    r = jc.rank
    mean = jax.lax.psum(u[:, 0], "x") / n  # a chain of psums
    total = jc.allreduce(u[:, 1]) / n  # a chain of jaxcomm allreduces
    right = u[:, 2]  # a ring shifted by ppermute
    left = u[:, 3]  # a ring shifted the other way by sendrecv

    def step(carry, _):
        mean, total, right, left = carry
        return (
            jax.lax.psum(mean, "x") / n + 1,
            jc.allreduce(total) / n - 1,
            jax.lax.ppermute(right, "x", [(i, (i + 1) % n) for i in range(n)]),
            jc.sendrecv(left, left, source=(r + 1) % n, dest=(r - 1) % n),
        ), None

    carry, _ = jax.lax.scan(step, (mean, total, right, left), None, length=steps)
    return jnp.stack(carry, axis=1)


program = jax.jit(jax.shard_map(mixed, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
runs = [program(state + 100 * i) for i in range(10)]
for i, out in enumerate(runs):
    start = ids + 100 * i
    want = [
        start[:, 0].mean() + steps,
        start[:, 1].mean() - steps,
        start[(jc.rank - steps) % n, 2],
        start[(jc.rank + steps) % n, 3],
    ]
    check(("mixed", i), out, jnp.asarray(want, jnp.float32)[None])
ok.append("mixed")

# Refusals, raised on every rank while compiling, before any MPI call.
def refused(error, text, run):
    try:
        run()
    except error as err:
        assert text in str(err), err
        return
    raise AssertionError(f"not refused: {text}")

refused(NotImplementedError, "outside shard_map", lambda: jax.jit(jc.allreduce)(x))
refused(NotImplementedError, "outside shard_map", lambda: jc.allreduce(x))
if size == 4:
    other = JaxComm.for_mesh(layouts["2d"], "x")
    refused(ValueError, "for_mesh", lambda: jax.jit(jax.shard_map(
        other.allreduce, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(x))
    refused(NotImplementedError, "automatic", lambda: jax.jit(jax.shard_map(
        world_jc.allreduce, mesh=layouts["2d"], in_specs=P("x"), out_specs=P("x"),
        axis_names={"x"}))(x))
half = Mesh(devices[:1], ("x",))
refused(ValueError, "one device of each of the", lambda: JaxComm.for_mesh(half, "x"))
refused(ValueError, "distinct axis names", lambda: JaxComm.for_mesh(mesh, "z"))
ok.append("refusals")

# Program order across calls: shard_map programs and eager calls on this
# process's own arrays, dispatched back to back without waiting, pair up
# with the same calls on the other ranks.
summed = jax.jit(jax.shard_map(jc.allreduce, mesh=mesh, in_specs=P("x"), out_specs=P()))
rotate = jax.jit(lambda v: world_jc.sendrecv(
    v, v, source=(world.rank - 1) % size, dest=(world.rank + 1) % size))
outs = []
for i in range(20):
    outs.append(summed(x * i))
    outs.append(rotate(jnp.float32(world.rank + 10 * i)))
    outs.append(world_jc.allreduce(jnp.float32(i)))
total = np.arange(2.0 * size).reshape(size, 2).sum(axis=0)
for i in range(20):
    mapped, rotated, eager = (np.asarray(o.addressable_shards[0].data) for o in outs[3 * i:3 * i + 3])
    assert np.allclose(mapped, total * i), (i, mapped)
    assert rotated == (world.rank - 1) % size + 10 * i and eager == size * i, (i, rotated, eager)
ok.append("order")
jaxcomm.sync()
if world.rank == 0:
    print("passed:", ", ".join(ok), flush=True)
"""


@spawns_own_mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_shard_map_collectives_match_jax(tmp_path, ranks):
    done, _ = run_job(tmp_path, _JOB, ranks=ranks, limit=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    expected = ["1d ('x',)", "replicated", "mixed", "refusals", "order"]
    if ranks == 4:
        expected += ["2d ('x',)", "2d ('y',)", "2d ('x', 'y')", "2d ('y', 'x')"]
    for case in expected:
        assert case in done.stdout, (case, done.stdout)


@pytest.mark.mpi
def test_for_mesh_needs_one_device_of_each_process():
    # Without jax.distributed every process sees only its own device.
    mesh = Mesh(np.array(jax.local_devices()[:1]), ("x",))
    if MPI.COMM_WORLD.size > 1:
        with pytest.raises(ValueError, match="one device of each of the .* jax.distributed"):
            JaxComm.for_mesh(mesh, "x")
        return
    jc = JaxComm.for_mesh(mesh, "x")
    assert (jc.rank, jc.size, jc.mesh_axes) == (0, 1, ("x",))
    total = jax.jit(jax.shard_map(jc.allreduce, mesh=mesh, in_specs=P("x"), out_specs=P()))
    np.testing.assert_array_equal(total(jnp.arange(3.0)), np.arange(3.0))
    jc.free()
    plain = JaxComm(MPI.COMM_WORLD)
    assert plain.mesh_axes is None
    plain.free()


# One device per process, inside jax.set_mesh ------------------------------------

# The context manager that sets a mesh: jax 0.7 and newer have jax.set_mesh,
# jax 0.6 jax.sharding.use_mesh.
_SET_MESH = getattr(jax, "set_mesh", None) or getattr(jax.sharding, "use_mesh", None)

_MESH_CONTEXT_JOB = """
import sys

import jaxcomm
from mpi4py import MPI

jaxcomm.initialize_jax_distributed()

import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from jaxcomm import JaxComm

size = MPI.COMM_WORLD.size
set_mesh = getattr(jax, "set_mesh", None) or jax.sharding.use_mesh
world = JaxComm()
world.allreduce(jnp.float32(1))  # jaxcomm has run before the mesh is set
ok = []
for kind in (AxisType.Explicit, AxisType.Auto):
    mesh = jax.make_mesh((size,), ("x",), axis_types=(kind,))
    with set_mesh(mesh):
        jaxcomm.sync()
        half = world.split(world.rank % 2)
        assert half.size == (size + 1 - world.rank % 2) // 2
        half.free()
        jx = JaxComm.for_mesh(mesh, "x")
        # Eager calls work on this process's own arrays: NumPy, JAX, pytrees.
        here = jax.device_put(np.float32(world.rank), jax.local_devices()[0])
        # (Compared as NumPy values: JAX's own operations on them would take
        # the mesh's devices.)
        assert np.asarray(world.allreduce(np.float32(1))) == size
        assert np.asarray(world.allreduce(here)) == size * (size - 1) / 2
        tree = world.allreduce({"a": np.ones(2, np.float32), "b": np.int32(2)})
        assert np.all(np.asarray(tree["a"]) == size) and np.asarray(tree["b"]) == 2 * size
        assert np.all(np.asarray(world.wait(world.iallreduce(np.ones(3, np.float32)))) == size)
        right, left = (world.rank + 1) % size, (world.rank - 1) % size
        assert np.asarray(world.sendrecv(here, here, source=left, dest=right)) == left
        # Programs over the mesh: shard_map with the mesh's communicator.
        x = jax.make_array_from_callback(
            (size,), NamedSharding(mesh, P("x")), lambda i: np.arange(size, dtype=np.float32)[i]
        )
        total = jax.jit(jax.shard_map(jx.allreduce, mesh=mesh, in_specs=P("x"), out_specs=P()))
        summed = np.asarray(total(x).addressable_shards[0].data)
        assert summed[0] == size * (size - 1) / 2, summed
        jx.free()
        jaxcomm.sync()
    ok.append(kind.name)
if world.rank == 0:
    print("passed:", ", ".join(ok), flush=True)
"""


@spawns_own_mpi
@pytest.mark.skipif(_SET_MESH is None, reason="this jax sets no mesh context")
@pytest.mark.parametrize("fast_dispatch", ["1", "0"])
def test_everything_works_inside_set_mesh(tmp_path, fast_dispatch):
    # The mesh holds every process's device; jaxcomm's own computations (the
    # fence of sync, split and for_mesh, eager calls) hold this process's only.
    done, _ = run_job(tmp_path, _MESH_CONTEXT_JOB, limit=300, JAXCOMM_FAST_DISPATCH=fast_dispatch)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "passed: Explicit, Auto" in done.stdout, done.stdout


@pytest.mark.mpi
@pytest.mark.skipif(_SET_MESH is None, reason="this jax sets no mesh context")
def test_a_one_device_mesh_context_changes_nothing(jc):
    # Without jax.distributed each process's mesh is its own device; the
    # jax.distributed job above is the case that needs the mesh cleared.
    mesh = Mesh(np.array(jax.local_devices()[:1]), ("x",))
    jc.allreduce(jnp.ones(2)).block_until_ready()
    with _SET_MESH(mesh):
        jaxcomm.sync()
        part = jc.split(0)
        np.testing.assert_array_equal(part.allreduce(np.ones(2, np.float32)), np.full(2, jc.size))
        part.free()
        np.testing.assert_array_equal(jc.wait(jc.ibcast(np.arange(3.0))), np.arange(3.0))
        jaxcomm.sync()


# A caught failure, and a failed rank, under jax.distributed + shard_map ---------

_CAUGHT_RAGGED_JOB = """
import jaxcomm
from mpi4py import MPI

jaxcomm.initialize_jax_distributed()

import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxcomm import JaxComm

n = MPI.COMM_WORLD.size
mesh = Mesh(np.array(jax.devices()), ("x",))
jx = JaxComm.for_mesh(mesh, "x")
blocks = NamedSharding(mesh, P("x"))


def spread(values, dtype):
    values = np.asarray(values, dtype)
    return jax.make_array_from_callback(values.shape, blocks, lambda i: values[i])


# Each device sends its row j to device j, which writes it at the sender's row,
# after a matrix product: XLA runs the exchange on one of its threads, after
# the call returned, and the failure reaches the program from the result.
product = jax.make_array_from_callback(
    (256, 256), NamedSharding(mesh, P()), lambda i: np.ones((256, 256), np.float32)[i])


def after_product(m, operand, *rest):
    return jx.ragged_all_to_all(operand + 0 * jnp.sin(m @ m).sum(), *rest)


exchange = jax.jit(jax.shard_map(
    after_product, mesh=mesh, in_specs=(P(),) + (P("x"),) * 6, out_specs=P("x")))
operand = spread(np.arange(n * n * 2).reshape(n * n, 2), np.float32)
output = spread(np.zeros((n * n, 2)), np.float32)
ones = spread(np.ones(n * n), np.int32)
starts = spread(np.tile(np.arange(n), n), np.int32)
good = spread(np.repeat(np.arange(n), n), np.int32)
# The last device writes past the end of its peers' outputs: every rank raises.
bad = spread(np.r_[np.repeat(np.arange(n - 1), n), np.full(n, n)], np.int32)
caught = 0
for where in (good, bad, good):
    try:
        result = exchange(product, operand, output, starts, ones, where, ones)
        np.asarray(result.addressable_shards[0].data)
    except Exception as err:
        assert "overruns the" in str(err) or "arguments are invalid" in str(err), err
        caught += 1
print(f"rank {jx.rank} caught {caught}", flush=True)
"""


@spawns_own_mpi
@pytest.mark.parametrize("fast_dispatch", ["1", "0"])
def test_a_failure_caught_inside_shard_map_is_raised_once(tmp_path, fast_dispatch):
    done, _ = run_job(tmp_path, _CAUGHT_RAGGED_JOB, limit=300, JAXCOMM_FAST_DISPATCH=fast_dispatch)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert done.stdout.count("caught 1") == 2, done.stdout
    assert "at exit" not in done.stderr, done.stderr


_FAILED_RANK_JOB = """
import time

import jaxcomm
from mpi4py import MPI

jaxcomm.initialize_jax_distributed()

import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxcomm import JaxComm

mesh = Mesh(np.array(jax.devices()), ("x",))
jx = JaxComm.for_mesh(mesh, "x")
n = jx.size
x = jax.make_array_from_callback(
    (n, 256), NamedSharding(mesh, P("x")), lambda i: np.ones((n, 256), np.float32)[i])
step = jax.jit(jax.shard_map(
    lambda v: jax.lax.fori_loop(0, 10, lambda i, v: jnp.tanh(v) + jx.allreduce(v) / n, v),
    mesh=mesh, in_specs=P("x"), out_specs=P("x")))
for i in range(1000):
    if i == 20 and jx.rank == 1:
        print(f"rank 1 raises at {time.time()}", flush=True)
        raise ValueError("rank 1 gives up inside shard_map")
    x = step(x)
print(f"rank {jx.rank} finished", flush=True)
"""


@spawns_own_mpi
def test_an_uncaught_exception_ends_a_shard_map_job(tmp_path):
    done, _ = run_job(tmp_path, _FAILED_RANK_JOB, limit=120)
    raised = re.search(r"rank 1 raises at ([0-9.]+)", done.stdout)
    if raised:
        print(
            f"shard_map: the job ended {time.time() - float(raised[1]):.1f} s after rank 1 raised"
        )
    assert done.returncode not in (0, 124, 137), (done.returncode, done.stderr[-5000:])
    assert "Traceback" in done.stderr, done.stderr[-5000:]
    assert "ValueError: rank 1 gives up inside shard_map" in done.stderr, done.stderr[-5000:]
    assert "aborting the MPI job" in done.stderr, done.stderr[-5000:]
    assert "rank 0 finished" not in done.stdout, done.stdout


_DROP_IN_JOB = """
import jaxcomm
from mpi4py import MPI

jaxcomm.initialize_jax_distributed()

from functools import partial

import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxcomm import JaxComm

size = MPI.COMM_WORLD.size
devices = np.array(sorted(jax.devices(), key=lambda d: -d.process_index))
cases = [(Mesh(devices, ("x",)), "x"), (Mesh(devices, ("x",)), ("x",))]
if size == 4:
    grid = Mesh(devices.reshape(2, 2), ("x", "y"))
    cases += [(grid, ("x", "y")), (grid, ("y", "x")), (grid, "y")]
ok = []


def exchange_step(exchange, axis_name, operand, output, input_offsets, send_sizes,
                  output_offsets, recv_sizes):
    # Written against jax.lax.ragged_all_to_all's signature: the exchange is an argument.
    y = exchange(operand * 2, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                 axis_name=axis_name)
    return jnp.tanh(y)


def pattern(n, rows, out_rows):
    # Blocks of 0 to 2 rows from every sender to every receiver, read in
    # order with a gap, written on the receiver in reverse sender order.
    rng = np.random.default_rng(n)
    sizes = rng.integers(0, 3, (n, n))
    input_offsets = np.cumsum(sizes + 1, axis=1) - sizes - 1
    output_offsets = np.array([[sizes[s + 1:, r].sum() for r in range(n)] for s in range(n)])
    assert input_offsets.max() + sizes.max() <= rows and sizes.sum(axis=0).max() <= out_rows
    return [input_offsets, sizes, output_offsets, sizes.T.copy()]


def model(operands, outputs, indices):
    # One process computes every position's result with JAX's semantics, as global arrays.
    input_offsets, sizes, output_offsets, _ = indices
    results = list(jnp.asarray(outputs))
    for s in range(len(results)):
        for r in range(len(results)):
            k, at, start = sizes[s, r], output_offsets[s, r], input_offsets[s, r]
            results[r] = results[r].at[at:at + k].set(2 * operands[s][start:start + k])
    return jnp.tanh(jnp.stack(results))


references = {}
for mesh, axis_name in cases:
    names = (axis_name,) if isinstance(axis_name, str) else axis_name
    n = int(np.prod([mesh.shape[a] for a in names]))
    others = [a for a in mesh.axis_names if a not in names]
    rows, out_rows, width = 3 * n, 2 * n + 1, 2
    indices = pattern(n, rows, out_rows)
    rng = np.random.default_rng(3)
    operands = rng.standard_normal((n, rows, width))
    outputs = rng.standard_normal((n, out_rows, width))
    weights = rng.standard_normal((n, out_rows, width))
    # Every line of the mesh along the axes makes the same exchange: the
    # global arrays repeat along the other axes.
    spec = P(*others, names) if others else P(names)
    repeat = lambda a: np.broadcast_to(a, (*[mesh.shape[o] for o in others], *a.shape))
    put = lambda a: jax.make_array_from_callback(
        repeat(a).shape, NamedSharding(mesh, spec), lambda i, a=a: repeat(a)[i])
    args = [put(a.astype(np.float32)) for a in (operands, outputs)]
    args += [put(a.astype(np.int32)) for a in indices]
    w = put(weights.astype(np.float32))
    jx = JaxComm.for_mesh(mesh, axis_name)
    exchanges = {
        "jax": jax.lax.ragged_all_to_all,
        "blocking": jx.ragged_all_to_all,
        "started": lambda *a, **k: jx.wait(jx.iragged_all_to_all(*a, **k)),
    }
    maps = {}
    for name, exchange in exchanges.items():
        def body(*a, exchange=exchange):
            squeeze = lambda v: v.reshape(v.shape[len(others) + 1:])
            y = exchange_step(exchange, axis_name, *map(squeeze, a))
            return y.reshape((1,) * (len(others) + 1) + y.shape)
        f = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)
        if name == "jax":
            # The same function lowers with JAX's collective; XLA:CPU cannot
            # compile it, other platforms compare with it too.
            assert "ragged_all_to_all" in jax.jit(f).lower(*args).as_text()
            if jax.devices()[0].platform == "cpu":
                continue
        maps[name] = f


    def every_exchange(operand, output, w, *rest):
        # Each exchange and its gradient apart, all in one program: one
        # compile per case, not two per exchange.
        runs = {}
        for name, f in maps.items():
            loss = lambda operand, output, f=f: jnp.sum(jnp.sin(f(operand, output, *rest)) * w)
            runs[name] = (f(operand, output, *rest), jax.grad(loss, argnums=(0, 1))(operand, output))
        return runs


    runs = jax.jit(every_exchange)(*args[:2], w, *args[2:])
    # The data and indices depend on n alone: cases of one n share the
    # model's results, computed once, as one program.
    if n not in references:
        references[n] = jax.jit(lambda a, b: (
            model(a, b, indices),
            jax.grad(lambda a, b: jnp.sum(jnp.sin(model(a, b, indices)) * weights), argnums=(0, 1))(a, b),
        ))(operands, outputs)
    want, want_grads = references[n]
    for name, (y, grads) in runs.items():
        for got, expected in ((y, want), *zip(grads, want_grads)):
            for shard in got.addressable_shards:
                block = np.asarray(shard.data).reshape(np.asarray(shard.data).shape[len(others):])
                index = shard.index[len(others):]
                assert np.allclose(block, np.asarray(expected)[index], rtol=1e-5, atol=1e-5), (
                    name, axis_name, block, np.asarray(expected)[index])
    ok.append(f"drop-in {axis_name!r}")
    jx.free()

# Refusals, on every rank while tracing, before any MPI call.
def refused(error, text, jc, mesh, axis_name, **kwargs):
    spec = P(mesh.axis_names)
    exchange = partial(jc.ragged_all_to_all, **kwargs)
    body = lambda *a: exchange_step(exchange, axis_name, *(v.reshape(-1) for v in a))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    ones = jax.make_array_from_callback(
        (size * size,), NamedSharding(mesh, spec), lambda i: np.ones(size * size, np.int32)[i])
    try:
        f(ones.astype(np.float32), ones.astype(np.float32), ones, ones, ones, ones)
    except error as err:
        assert text in str(err), err
        return
    raise AssertionError(f"not refused: {text}")


line = Mesh(devices, ("x",))
jx = JaxComm.for_mesh(line, "x")
world = JaxComm(MPI.COMM_WORLD)
refused(ValueError, "communicates along the mesh axes", jx, line, "z")
refused(ValueError, "was not made by JaxComm.for_mesh", world, line, "x")
refused(NotImplementedError, "axis_index_groups", jx, line, "x", axis_index_groups=[[0, 1]])
if size == 4:
    grid = Mesh(devices.reshape(2, 2), ("x", "y"))
    both = JaxComm.for_mesh(grid, ("x", "y"))
    refused(ValueError, "numbers the positions", both, grid, ("y", "x"))
    refused(ValueError, "communicates along the mesh axes", both, grid, "x")
    both.free()
ok.append("refusals")
jaxcomm.sync()
if MPI.COMM_WORLD.rank == 0:
    print("passed:", ", ".join(ok), flush=True)
"""


@spawns_own_mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_ragged_all_to_all_is_a_drop_in_for_jax(tmp_path, ranks):
    # A function written against jax.lax.ragged_all_to_all's signature, given
    # jaxcomm's exchange of a for_mesh communicator: forward and gradients as
    # JAX's semantics give them, over 1-D and 2-D meshes and groups of axes.
    done, _ = run_job(tmp_path, _DROP_IN_JOB, ranks=ranks, limit=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    expected = ["drop-in 'x'", "drop-in ('x',)", "refusals"]
    if ranks == 4:
        expected += ["drop-in ('x', 'y')", "drop-in ('y', 'x')", "drop-in 'y'"]
    for case in expected:
        assert case in done.stdout, (case, done.stdout)
