"""More than one local device per process: jaxcomm refuses, naming the way out."""

import subprocess
import sys

from conftest import environment_without_launcher, spawns_own_mpi

_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxcomm import JaxComm

jc = JaxComm()
assert jax.device_count() == 2
mesh = Mesh(np.array(jax.devices()), ("d",))
x = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P("d")))
allreduce = jax.jit(jc.allreduce)
print("one device:", allreduce(jnp.arange(4.0)).tolist(), flush=True)
cases = {
    "sharded jit": lambda: allreduce(x),
    "eager on a sharded array": lambda: jc.allreduce(x),
    "shard_map": lambda: jax.jit(
        jax.shard_map(jc.allreduce, mesh=mesh, in_specs=P("d"), out_specs=P("d"))
    )(x),
    "vmap in shard_map": lambda: jax.jit(
        jax.shard_map(jax.vmap(jc.allreduce), mesh=mesh, in_specs=P("d"), out_specs=P("d"))
    )(x.reshape(2, 2)),
}
for name, run in cases.items():
    try:
        run()
    except NotImplementedError as err:
        assert "over 2 devices" in str(err) and "one MPI process per device" in str(err), err
        print("refused:", name, flush=True)
"""


@spawns_own_mpi
def test_several_devices_per_process_are_refused_clearly(tmp_path):
    script = tmp_path / "two_devices.py"
    script.write_text(_SCRIPT)
    env = environment_without_launcher(XLA_FLAGS="--xla_force_host_platform_device_count=2")
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    assert "one device: [0.0, 1.0, 2.0, 3.0]" in done.stdout
    assert done.stdout.count("refused:") == 4, done.stdout
