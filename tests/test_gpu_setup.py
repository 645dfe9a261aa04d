"""The GPU plumbing that runs without a GPU: data-path switches, cuda_info,
bind_local_gpu and the build's CUDA module. tests/gpu/ holds the tests that
move arrays in GPU memory."""

import os
import re
import subprocess
import sys
from functools import partial

import pytest
from at_once import at_once
from conftest import environment_without_launcher, mpiexec, spawns_own_mpi

import jaxcomm
from jaxcomm import _build_info, _gpu, _runtime


def _clean_env(**extra):
    env = environment_without_launcher()
    # PYTHONUNBUFFERED would split a print's text from its newline, and mix
    # the ranks' lines.
    for name in (
        "CUDA_VISIBLE_DEVICES",
        "XLA_PYTHON_CLIENT_PREALLOCATE",
        "JAXCOMM_CUDA_AWARE",
        "PYTHONUNBUFFERED",
    ):
        env.pop(name, None)
    env.update(extra)
    return env


def _run(argv, env, timeout=180):
    # Away from the source tree, whose jaxcomm has no compiled kernels.
    return subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=os.path.dirname(sys.executable),
    )


@pytest.mark.mpi
def test_cuda_info_describes_the_build():
    info = jaxcomm.cuda_info()
    assert set(info) == {
        "built",
        "gpus",
        "mpi_cuda_support",
        "cuda_aware",
        "path",
        "reason",
        "staging_bytes",
    }
    assert info["built"] is _build_info.CUDA
    assert info["built"] == (_runtime.cuda_kernels is not None)
    assert isinstance(info["gpus"], int) and info["gpus"] >= 0
    if info["built"]:
        assert info["path"] == ("cuda-aware" if info["cuda_aware"] else "host staging")
        assert info["mpi_cuda_support"] in (True, False, None)
        assert info["staging_bytes"] >= 0
    else:
        assert info["path"] is None and not info["cuda_aware"]
        assert "JAXCOMM_CUDA=ON" in info["reason"]


@pytest.mark.mpi
def test_set_cuda_aware_switches_the_path_and_back():
    if not _runtime.CUDA_BUILT:
        pytest.skip("jaxcomm was built without CUDA kernels")
    saved = _gpu._override  # JAXCOMM_CUDA_AWARE's, if set: put back at the end
    try:
        jaxcomm.set_cuda_aware(None)
        automatic = jaxcomm.cuda_info()
        assert automatic["cuda_aware"] is (automatic["mpi_cuda_support"] is True)
        for enabled in (True, False):
            jaxcomm.set_cuda_aware(enabled)
            info = jaxcomm.cuda_info()
            assert info["cuda_aware"] is enabled
            assert info["path"] == ("cuda-aware" if enabled else "host staging")
            assert info["reason"].startswith("set by set_cuda_aware()")
            assert bool(_runtime.cuda_kernels.cuda_aware()) is enabled
        jaxcomm.set_cuda_aware(None)
        assert jaxcomm.cuda_info() == automatic
    finally:
        _gpu.apply_data_path(*(saved or (None, "")))


@pytest.mark.mpi
@pytest.mark.parametrize("value", ["yes", 1, 0.0])
def test_set_cuda_aware_takes_only_true_false_none(value):
    with pytest.raises(TypeError, match="enabled must be True, False or None"):
        jaxcomm.set_cuda_aware(value)


@pytest.mark.mpi
def test_bind_local_gpu_too_late_raises_on_every_rank():
    import jax

    jax.devices()  # the backends exist from here on
    with pytest.raises(RuntimeError, match="after JAX initialised its backends"):
        jaxcomm.bind_local_gpu()


_BIND = """
import os, jaxcomm
from mpi4py import MPI
try:
    index = jaxcomm.bind_local_gpu()
except RuntimeError as err:
    print(f"r{MPI.COMM_WORLD.rank} error {err}", flush=True)
else:
    print(f"r{MPI.COMM_WORLD.rank} index {index} visible {os.environ['CUDA_VISIBLE_DEVICES']} "
          f"preallocate {os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE')}", flush=True)
"""


@spawns_own_mpi
def test_bind_local_gpu_spreads_a_nodes_ranks_over_its_gpus(tmp_path):
    script = tmp_path / "bind.py"
    script.write_text(_BIND)
    env = _clean_env(
        CUDA_VISIBLE_DEVICES="4,6", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1"
    )
    done = _run([*mpiexec(3), sys.executable, str(script)], env)
    assert done.returncode == 0, done.stderr
    # Ranks' lines may interleave; each one's fields are found whole.
    line = r"r(\d) index (\d) visible (\d) preallocate (false|true|None)"
    found = sorted(re.findall(line, done.stdout))
    # Three ranks, two GPUs: they share, so JAX must not preallocate.
    assert found == [
        ("0", "0", "4", "false"),
        ("1", "1", "6", "false"),
        ("2", "0", "4", "false"),
    ], done.stdout


@spawns_own_mpi
def test_bind_local_gpu_alone_keeps_preallocation_and_finds_no_gpu_clearly(tmp_path):
    script = tmp_path / "bind.py"
    script.write_text(_BIND)
    one_gpu, no_gpu = at_once(
        *(
            partial(_run, [sys.executable, str(script)], _clean_env(CUDA_VISIBLE_DEVICES=visible))
            for visible in ("2", "")
        )
    )
    done = one_gpu
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "r0 index 0 visible 2 preallocate None"
    done = no_gpu
    assert done.returncode == 0, done.stderr
    assert "r0 error jaxcomm.bind_local_gpu(): no NVIDIA GPU found" in done.stdout


@spawns_own_mpi
@pytest.mark.skipif(not _build_info.CUDA, reason="jaxcomm was built without CUDA kernels")
def test_jaxcomm_cuda_aware_environment_variable():
    script = "import jaxcomm; info = jaxcomm.cuda_info(); print(info['path'], '|', info['reason'])"
    on, off, wrong = at_once(
        *(
            partial(_run, [sys.executable, "-c", script], _clean_env(JAXCOMM_CUDA_AWARE=value))
            for value in ("1", "0", "yes")
        )
    )
    done = on
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("cuda-aware | set by JAXCOMM_CUDA_AWARE")
    done = off
    assert done.stdout.startswith("host staging | set by JAXCOMM_CUDA_AWARE")
    done = wrong
    assert done.returncode != 0
    assert "JAXCOMM_CUDA_AWARE must be 0 or 1, got 'yes'" in done.stderr


@pytest.mark.skipif(not _build_info.CUDA, reason="jaxcomm was built without CUDA kernels")
def test_cuda_module_loads_without_a_cuda_runtime_library():
    # The runtime is linked statically: importing jaxcomm on a machine with
    # the CUDA module but no libcudart (or another version of it) works.
    linked = subprocess.run(
        # The CUDA module itself, also where JAXCOMM_EMULATE_CUDA=1 puts the
        # emulated one in its place.
        ["ldd", _runtime._load_kernels("_kernels_cuda").__file__],
        capture_output=True,
        text=True,
    ).stdout
    assert "libjaxcomm_cuda" in linked and "libjaxcomm_core" in linked, linked
    assert "libcudart" not in linked, linked


_LOADED = """
import sys, jax, jaxcomm
from jaxcomm import _compat, _runtime
assert not _compat.backends_initialized(), "importing jaxcomm started JAX"
loaded = sorted(m.split(".")[1] for m in sys.modules if m.startswith("jaxcomm._kernels_"))
print("plugin", _runtime.cuda_plugin_installed(), "loaded", " ".join(loaded))
"""


@pytest.mark.skipif(not _build_info.CUDA, reason="jaxcomm was built without CUDA kernels")
def test_the_cuda_module_is_loaded_only_where_jax_has_a_cuda_plugin(tmp_path):
    # A CPU-only program never loads the CUDA module. JAX finds its CUDA
    # plugin (jax[cuda12], jax[cuda13]) in the jax_plugins namespace: a
    # stand-in there, which JAX would only import when it starts its
    # backends, makes jaxcomm load and register the CUDA kernels at import.
    plugin = tmp_path / "jax_plugins" / "xla_cuda99"
    plugin.mkdir(parents=True)
    (plugin / "__init__.py").write_text("def initialize():\n    pass\n")
    # The environment's own plugins, if any, decide the case without the stand-in.
    env = _clean_env()
    env.pop("JAXCOMM_EMULATE_CUDA", None)  # which loads the emulated module in place of the CPU's
    done = _run([sys.executable, "-c", _LOADED], env)
    assert done.returncode == 0, done.stderr
    own = done.stdout.split()[1] == "True"
    assert done.stdout.split("loaded")[1].split() == (
        ["_kernels_cpu", "_kernels_cuda"] if own else ["_kernels_cpu"]
    ), done.stdout
    with_stand_in = dict(env, PYTHONPATH=str(tmp_path))
    done = _run([sys.executable, "-c", _LOADED], with_stand_in)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["plugin", "True", "loaded", "_kernels_cpu", "_kernels_cuda"], (
        done.stdout
    )


# Under the emulated CUDA runtime (tests/cuda_emulation/README.md) the CUDA
# kernels' staging layer runs on the CPU, and these check its memory reuse.
_EMULATED = hasattr(_runtime.cuda_kernels, "host_allocations")


@pytest.mark.mpi
@pytest.mark.skipif(not _EMULATED, reason="needs JAXCOMM_EMULATE_CUDA=1")
def test_staging_memory_is_allocated_once_and_reused(jc):
    import jax
    import jax.numpy as jnp
    import numpy as np

    kernels = _runtime.cuda_kernels
    ring = dict(source=(jc.rank - 1) % jc.size, dest=(jc.rank + 1) % jc.size)

    def body(_, x):
        x = jc.allreduce(x) / jc.size
        x = jc.bcast(x, root=0)
        return jc.sendrecv(x, x, **ring)

    saved = _gpu._override
    try:
        jaxcomm.set_cuda_aware(False)
        _check_staging_reuse(jc, jax.jit(lambda x, n: jax.lax.fori_loop(0, n, body, x)))
        # The direct path stages nothing but envelopes: a larger allreduce
        # than any before leaves the pinned memory as it was.
        jaxcomm.set_cuda_aware(True)
        held = kernels.staging_bytes()
        big = jnp.ones(8 << 20, jnp.float32)
        np.testing.assert_array_equal(jc.allreduce(big), np.full(8 << 20, jc.size, np.float32))
        assert kernels.staging_bytes() == held
    finally:
        _gpu.apply_data_path(*(saved or (None, "")))


def _check_staging_reuse(jc, loop):
    import jax
    import jax.numpy as jnp
    import numpy as np

    kernels = _runtime.cuda_kernels
    x = jnp.arange(1000.0)
    jax.block_until_ready(loop(x, 10))
    allocations, held = kernels.host_allocations(), kernels.staging_bytes()
    out = loop(x, 10_000)
    for _ in range(100):
        out = jc.allreduce(out) / jc.size
    np.testing.assert_array_equal(out, np.arange(1000.0))
    assert kernels.host_allocations() == allocations
    assert kernels.staging_bytes() == held

    # A larger call grows the memory once; the next calls reuse it as one
    # block. (Blocks that nonblocking requests gave back to their pool, from
    # earlier tests, are live allocations too: count from here.)
    live = kernels.live_host_allocations()
    big = jnp.ones(4 << 20, jnp.float32)
    np.testing.assert_array_equal(jc.allreduce(big), np.full(4 << 20, jc.size, np.float32))
    grown = kernels.staging_bytes()
    assert grown > held
    for _ in range(3):
        jc.allreduce(big)
        jc.allreduce(x)
    assert kernels.staging_bytes() == grown
    assert kernels.live_host_allocations() == live
