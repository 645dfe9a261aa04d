"""The examples, run in-process on the current ranks (CI also runs some as written, on 4 ranks).

shard_map_mpi.py starts jax.distributed, which must come before JAX's backends: it runs
in an MPI launch of its own.
"""

import pathlib
import re
import runpy
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import environment_without_launcher, mpiexec, spawns_own_mpi
from mpi4py import MPI

from jaxcomm import _compat

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def run_example(monkeypatch, capsys, name, *args):
    """Run ``examples/name`` with command-line ``args``; its stdout (rank 0's lines)."""
    path = str(EXAMPLES / name)
    monkeypatch.setattr(sys, "argv", [path, *map(str, args)])
    runpy.run_path(path, run_name="__main__")
    return capsys.readouterr().out


@pytest.fixture
def keep_x64():
    """Restores jax_enable_x64 after an example that turns it on (poisson_cg.py)."""
    x64 = jax.config.jax_enable_x64
    yield
    jax.config.update("jax_enable_x64", x64)


def numbers_after(label, text):
    """The numbers that follow each occurrence of ``label`` in ``text``."""
    return [float(n) for n in re.findall(re.escape(label) + r" ([-+.\deE]+)", text)]


@pytest.mark.mpi
def test_global_sum_prints_the_sum_of_ranks(capsys):
    runpy.run_path(str(EXAMPLES / "global_sum.py"), run_name="__main__")
    out = capsys.readouterr().out
    world = MPI.COMM_WORLD
    if world.rank == 0:
        values = np.array(out.replace("[", " ").replace("]", " ").split(), dtype=float)
        np.testing.assert_array_equal(values, np.full(9, float(sum(range(world.size)))))
    else:
        assert out == ""


@pytest.mark.mpi
def test_send_recv_swaps_between_two_ranks(capsys):
    world = MPI.COMM_WORLD
    if world.size != 2:
        # Size-based, so every rank takes the same branch.
        with pytest.raises(SystemExit, match="exactly 2 ranks"):
            runpy.run_path(str(EXAMPLES / "send_recv.py"), run_name="__main__")
        return
    runpy.run_path(str(EXAMPLES / "send_recv.py"), run_name="__main__")
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all(line.startswith(f"r{world.rank} | ") for line in lines)
    numbers = " ".join(line.split("|", 1)[1] for line in lines)
    values = np.array(numbers.replace("[", " ").replace("]", " ").split(), dtype=float)
    np.testing.assert_array_equal(values, np.full(9, float(1 - world.rank)))


@pytest.mark.mpi
def test_halo_exchange_matches_serial(capsys):
    runpy.run_path(str(EXAMPLES / "halo_exchange.py"), run_name="__main__")
    out = capsys.readouterr().out
    if MPI.COMM_WORLD.rank == 0:
        assert "max difference from serial" in out
        # float32 distributed run against a float64 serial one.
        assert float(out.split()[-1]) < 1e-5


@pytest.mark.mpi
def test_mesh_ghosts_gradient_matches_single_process(monkeypatch, capsys, keep_x64):
    out = run_example(monkeypatch, capsys, "mesh_ghosts.py", "--nodes", 40, "--chords", 30)
    if MPI.COMM_WORLD.rank == 0:
        (difference,) = numbers_after("max difference from single process", out)
        # Gradient and energy both, against one process on the whole mesh.
        assert difference < 1e-10
        assert f"{MPI.COMM_WORLD.size} ranks" in out
    else:
        assert out == ""


@pytest.mark.mpi
def test_mpi4jax_style_heat_runs_alike_through_compat_and_jaxcomm(monkeypatch, capsys):
    # 48 cells split evenly over the grids of 1 to 4 ranks.
    out = run_example(
        monkeypatch, capsys, "heat_mpi4jax_style.py", "--cells", "48", "48", "--steps", "30"
    )
    if MPI.COMM_WORLD.rank == 0:
        assert "compat and JaxComm runs identical: True," in out, out
        assert numbers_after("max difference from serial", out) == [0.0], out
    else:
        assert out == ""


@pytest.mark.mpi
def test_data_parallel_training_matches_single_process(monkeypatch, capsys):
    out = run_example(
        monkeypatch, capsys, "data_parallel.py", "--epochs", 3, "--batches", 4, "--batch-size", 24
    )
    world = MPI.COMM_WORLD
    if world.rank == 0:
        lines = out.splitlines()
        assert [line.split(":")[0] for line in lines[:-1]] == [f"epoch {e}/3" for e in (1, 2, 3)]
        losses, serial = numbers_after("loss", out), numbers_after("single process", out)
        assert len(losses) == len(serial) == 4
        assert losses[0] > losses[1] > losses[2]  # it trained
        np.testing.assert_allclose(losses, serial, atol=2e-4)  # printed to 4 decimals
        assert lines[-1].startswith(f"{world.size} ranks, 12 steps: loss ")
        assert numbers_after("max difference from single-process training", out)[0] < 1e-5


@pytest.mark.mpi
def test_scatter_allreduce_grad_prints_the_same_sum_on_every_rank(capsys):
    runpy.run_path(str(EXAMPLES / "scatter_allreduce_grad.py"), run_name="__main__")
    world = MPI.COMM_WORLD
    # Rank r's chunk is [2r, 2r + 1]; the last rank doubles its chunk.
    want = sum((4 * r + 1) * (2 if r == world.size - 1 else 1) for r in range(world.size))
    # Root's gradient: 1 per element, 2 on the last rank's doubled chunk.
    gradient = np.zeros(2 * world.size, np.float32)
    if world.rank == 0:
        gradient[:] = 1
        gradient[-2:] = 2
    assert capsys.readouterr().out == (
        f"Rank {world.rank} has result {float(want)}\n"
        f"Rank {world.rank} has result {float(want)} and gradient {gradient}\n"
    )


@pytest.mark.mpi
@pytest.mark.parametrize("boundary", ["periodic", "walls"])
def test_shallow_water_matches_serial_and_conserves_mass(monkeypatch, capsys, boundary):
    # 24 cells per axis divide over the 1x1, 2x1 and 3x1 process grids.
    out = run_example(
        monkeypatch,
        capsys,
        "shallow_water.py",
        "--cells",
        24,
        24,
        "--steps",
        30,
        "--boundary",
        boundary,
        "--benchmark",
    )
    if MPI.COMM_WORLD.rank == 0:
        assert f"24x24 cells, {boundary}, 30 steps" in out
        # float32, the same operations as the serial run: 0 or a few roundings.
        assert numbers_after("max difference from serial", out)[0] < 1e-5
        assert numbers_after("mass change", out)[0] < 1e-5
        low, high = map(float, re.search(r"final height ([.\d]+) to ([.\d]+)", out).groups())
        # The hump (1.5 high) spread, and no cell ran dry or blew up.
        assert 0.8 < low < 1.0 < high < 1.4
        assert re.search(r"benchmark: [.\d]+ ms per step, \d+ steps/s, [.\de+]+ cells/s", out)


# Whether XLA compiles the overlapped step's arithmetic as the blocking
# one's, bit for bit: measured on jax 0.8 and newer. XLA:CPU of jaxlib 0.6.2
# rounds the two programs differently (fields at most 3e-11 apart after 30
# steps, a rounding), so there the overlapped field is checked against the
# serial one.
EXACT_OVERLAP = _compat.JAX_VERSION >= (0, 8)


@pytest.mark.mpi
@pytest.mark.parametrize("boundary", ["periodic", "walls"])
def test_shallow_water_overlapped_gives_the_blocking_field(monkeypatch, capsys, boundary):
    # The script itself compares the overlapped field with the blocking one
    # (bit for bit) under --benchmark, and exits if they differ.
    benchmark = ["--benchmark"] if EXACT_OVERLAP else []
    out = run_example(
        monkeypatch,
        capsys,
        "shallow_water.py",
        "--cells",
        24,
        24,
        "--steps",
        30,
        "--boundary",
        boundary,
        "--overlap",
        *benchmark,
    )
    if MPI.COMM_WORLD.rank == 0:
        assert f"24x24 cells, {boundary}, overlapped, 30 steps" in out
        assert numbers_after("max difference from serial", out)[0] < 1e-5
        assert numbers_after("mass change", out)[0] < 1e-5
        for name in ("overlapped", "blocking") if EXACT_OVERLAP else ():
            assert re.search(rf"{name}: [.\d]+ ms per step, \d+ steps/s, [.\de+]+ cells/s", out)


# Tiny sizes that divide over 1, 2 and 3 ranks.
PLOTS = {
    "shallow_water.py": ("--cells", 12, 12, "--steps", 2, "--boundary", "walls"),
    "poisson_cg.py": ("--size", 6),
}


@pytest.mark.mpi
@pytest.mark.parametrize("example", PLOTS)
def test_plot_saves_a_png(monkeypatch, capsys, tmp_path, keep_x64, example):
    pytest.importorskip("matplotlib")
    path = tmp_path / "figure.png"
    out = run_example(monkeypatch, capsys, example, *PLOTS[example], "--plot", path)
    if MPI.COMM_WORLD.rank == 0:
        assert f"saved {path}" in out
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.mpi
@pytest.mark.parametrize("example", PLOTS)
def test_plot_without_matplotlib_names_the_extra(monkeypatch, capsys, tmp_path, keep_x64, example):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    with pytest.raises(SystemExit):
        run_example(monkeypatch, capsys, example, "--plot", tmp_path / "figure.png")
    assert 'pip install "jaxcomm[examples]"' in capsys.readouterr().err


@pytest.mark.mpi
def test_poisson_cg_matches_serial_and_its_gradient_finite_differences(
    monkeypatch, capsys, keep_x64
):
    # 12 unknowns per axis divide over 1, 2 and 3 ranks.
    out = run_example(monkeypatch, capsys, "poisson_cg.py", "--size", 12)
    if MPI.COMM_WORLD.rank == 0:
        iterations = int(re.search(r"CG took (\d+) iterations", out).group(1))
        assert 0 < iterations <= 144
        assert numbers_after("|f - A u| / |f|", out)[0] < 1e-11
        assert numbers_after("from single-process jax.scipy.sparse.linalg.cg", out)[0] < 1e-10
        gradients = numbers_after("jax.grad", out)
        estimates = numbers_after("finite difference", out)
        assert len(gradients) == 2 and all(g != 0 for g in gradients)
        np.testing.assert_allclose(gradients, estimates, rtol=1e-6)
        assert all(d < 1e-6 for d in numbers_after("relative difference", out))


@pytest.mark.mpi
@pytest.mark.parametrize("shape", [(12, 12, 12), (12, 24)], ids=["3d", "2d"])
def test_fft_pencil_matches_fftn_and_inverts(monkeypatch, capsys, shape):
    out = run_example(
        monkeypatch, capsys, "fft_pencil.py", "--shape", *shape, "--benchmark", "--repeat", 2
    )
    if MPI.COMM_WORLD.rank == 0:
        assert out.startswith("x".join(map(str, shape)) + " complex64")
        assert numbers_after("max difference from jnp.fft.fftn", out)[0] < 1e-5
        assert numbers_after("inverse round trip", out)[0] < 1e-5
        assert re.search(r"benchmark: forward [.\d]+ ms, inverse [.\d]+ ms, jnp.fft.fftn", out)


@pytest.mark.mpi
def test_fft_pencil_rejects_a_shape_the_grid_cannot_split(monkeypatch, capsys):
    size = MPI.COMM_WORLD.size
    args = ("fft_pencil.py", "--shape", size + 1, 12)
    if size == 1:
        # Every size divides over one process.
        run_example(monkeypatch, capsys, *args)
        return
    with pytest.raises(SystemExit, match=f"must divide by {size}"):
        run_example(monkeypatch, capsys, *args)


@pytest.mark.mpi
@pytest.mark.parametrize("method", ["alltoallv", "ragged"])
def test_particles_arrive_once_on_their_owner_and_match_the_serial_motion(
    monkeypatch, capsys, method
):
    # --capacity 1 starts at the fullest rank's count, so a step that brings
    # it more particles than it sends overflows and grows the capacity.
    args = ("--particles", 600, "--steps", 40, "--capacity", 1, "--method", method)
    out = run_example(monkeypatch, capsys, "particles.py", *args)
    if MPI.COMM_WORLD.rank == 0:
        size = MPI.COMM_WORLD.size
        assert out.startswith(f"{size} ranks, 40 steps, 600 particles ({method}, capacity "), out
        for check in ("particles conserved", "ids unique", "all on owner"):
            assert f"{check}: True" in out, out
        assert numbers_after("max position error", out) == [0.0], out
    else:
        assert out == ""


@spawns_own_mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_shard_map_mpi_matches_jax_collectives_and_serial(ranks):
    # jax.distributed must start before JAX's backends: a launch of its own.
    done = subprocess.run(
        [
            "timeout",
            "-k",
            "10",
            "300",
            *mpiexec(ranks),
            sys.executable,
            str(EXAMPLES / "shard_map_mpi.py"),
            "--steps",
            "20",
            "--benchmark",
        ],
        capture_output=True,
        text=True,
        env=environment_without_launcher(),
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    out = done.stdout
    assert f"{ranks} processes, {16 * ranks} cells, 20 steps:" in out, out
    state, heat, energy, gradient = _shard_map_differences(out)
    # float32 sums added in different orders by MPI and gloo: rounding only.
    assert max(state, heat, gradient) < 1e-5 and energy < 1e-4, out
    assert numbers_after("max difference from serial", out)[0] < 1e-5, out
    assert re.search(r"^benchmark: .* jax [\d.]+ us, jaxcomm [\d.]+ us", out, re.M), out


def _shard_map_differences(out):
    """The four differences shard_map_mpi.py prints: state, heat, energy, gradient."""
    found = re.search(
        r"differ by ([-+.\deE]+) \(state\), ([-+.\deE]+) \(heat\), ([-+.\deE]+) \(energy\), "
        r"([-+.\deE]+) \(energy gradient\)",
        out,
    )
    assert found, out
    return [float(v) for v in found.groups()]
