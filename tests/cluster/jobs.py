"""jaxcomm's multi-process setup across the cluster's hosts (tests/cluster/cluster.sh).

Usage (from the root namespace, the venv active, the cluster up)::

    python tests/cluster/jobs.py JOB --launcher srun --hosts 2 --per-host 2

JOB is one of:

- ``shard_map``: the job of tests/test_shard_map.py, as it is written there
  (``initialize_jax_distributed``, ``JaxComm.for_mesh`` on 1-d and 2x2
  meshes, jaxcomm's collectives inside ``shard_map`` against JAX's own,
  results and gradients), on every host.
- ``jax_distributed``: JAX's own ``jax.distributed.initialize()`` with no
  argument (it reads Slurm's variables: ``srun`` only), then a ``psum`` in
  ``shard_map`` against jaxcomm's ``allreduce`` on ``for_mesh``.
- ``local_ranks``: ``bind_local_gpu`` with eight GPUs listed in
  ``CUDA_VISIBLE_DEVICES``: each host's ranks must take GPUs 0, 1, ... of
  their own host, not numbers counted over the job.

Exits non-zero, with the reason, unless every rank's result is right.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import multihost  # noqa: E402 - the sibling module, found through the path above

TESTS = Path(__file__).resolve().parents[1]

JAX_DISTRIBUTED = """
import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")  # psum between CPU processes
jax.distributed.initialize()

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from mpi4py import MPI

from jaxcomm import JaxComm

world = MPI.COMM_WORLD
assert jax.process_count() == world.size, (jax.process_count(), world.size)
assert jax.process_index() == world.rank, (jax.process_index(), world.rank)
mesh = Mesh(np.array(jax.devices()), ("x",))
jc = JaxComm.for_mesh(mesh, "x")
data = np.arange(3.0 * world.size).reshape(world.size, 3)
x = jax.make_array_from_callback(data.shape, NamedSharding(mesh, P("x")), lambda i: data[i])
theirs = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P()))(x)
ours = jax.jit(jax.shard_map(jc.allreduce, mesh=mesh, in_specs=P("x"), out_specs=P()))(x)
right = np.array_equal(np.asarray(theirs.addressable_shards[0].data), data.sum(axis=0, keepdims=True))
right &= np.array_equal(np.asarray(ours.addressable_shards[0].data), data.sum(axis=0, keepdims=True))
right = world.allreduce(bool(right), op=MPI.LAND)
if world.rank == 0:
    print(f"jax.distributed: {jax.process_count()} processes, psum and allreduce right: {right}", flush=True)
"""

LOCAL_RANKS = """
import os
import socket

os.environ["CUDA_VISIBLE_DEVICES"] = "0,1,2,3,4,5,6,7"
import jaxcomm
from mpi4py import MPI

gpu = jaxcomm.bind_local_gpu()
print(f"local: {MPI.COMM_WORLD.rank} {socket.gethostname()} {gpu} {os.environ['CUDA_VISIBLE_DEVICES']}", flush=True)
"""


def shard_map_job() -> str:
    """The text of tests/test_shard_map.py's ``_JOB``, read without importing that file."""
    tree = ast.parse((TESTS / "test_shard_map.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [
            t.id for t in node.targets if isinstance(t, ast.Name)
        ] == ["_JOB"]:
            return ast.literal_eval(node.value)
    raise RuntimeError("tests/test_shard_map.py has no _JOB")


def main() -> int:
    """Runs one job across hosts and checks what it printed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("job", choices=["shard_map", "jax_distributed", "local_ranks"])
    parser.add_argument("--launcher", choices=["srun", "mpiexec", "mpirun"], required=True)
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--per-host", type=int, default=2)
    args = parser.parse_args()
    text = {"shard_map": shard_map_job, "jax_distributed": lambda: JAX_DISTRIBUTED}.get(
        args.job, lambda: LOCAL_RANKS
    )()
    script = multihost.DIR / f"job_{args.job}.py"
    script.write_text(text)
    done = multihost.run(
        args.launcher, args.hosts, args.per_host, ["python", str(script)], timeout=600, capture=True
    )
    print(done.stdout[-6000:], end="", flush=True)
    if done.returncode != 0:
        print(f"{args.job}: the job failed ({done.returncode})")
        return 1
    ranks = args.hosts * args.per_host
    if args.job == "shard_map":
        expected = ["1d ('x',)", "replicated", "mixed", "refusals", "order"]
        if ranks == 4:
            expected += ["2d ('x',)", "2d ('y',)", "2d ('x', 'y')", "2d ('y', 'x')"]
        missing = [case for case in expected if case not in done.stdout]
        assert not missing, f"shard_map: cases not passed: {missing}"
    elif args.job == "jax_distributed":
        assert f"jax.distributed: {ranks} processes, psum and allreduce right: True" in done.stdout
    else:
        gpus = defaultdict(list)
        for line in done.stdout.splitlines():
            if line.startswith("local: "):
                _, rank, host, gpu, visible = line.split()
                assert visible == gpu, line
                gpus[host].append(int(gpu))
        assert sum(map(len, gpus.values())) == ranks, dict(gpus)
        assert len(gpus) == args.hosts, dict(gpus)
        for host, taken in gpus.items():
            assert sorted(taken) == list(range(args.per_host)), (host, taken)
    print(f"{args.job}: {args.launcher} {args.hosts}x{args.per_host}: right", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
