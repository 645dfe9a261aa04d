"""Tests for the source checkout's benchmarks (``benchmarks/``): their commands,
the GPU command on CPU arrays, the rank sweep, JAX's route and the cost model.

They import the benchmarks from the repository's root and jaxcomm from the
installed package, as ``python -m benchmarks.<name>`` does. Tiny sizes and
repeats: these check that every route is measured, checked and reported,
never how fast anything is.
"""

import importlib
import json
import pathlib
import subprocess
import sys
from functools import partial

import numpy as np
import pytest
from at_once import at_once
from conftest import environment_without_launcher, mpiexec, spawns_own_mpi

from jaxcomm import bench
from jaxcomm.bench.routes import c_floor

# After conftest.py took the installed jaxcomm: the root, last on sys.path,
# gives the benchmarks package and nothing else.
ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))

from benchmarks import gpu, model, plots, scaling  # noqa: E402


def test_plot_writes_a_png_or_says_what_is_missing(tmp_path, monkeypatch):
    records = [
        bench.Record("allreduce", mode, n, impl, 2, 1, 1, time_s=1e-6 * n, match=True)
        for mode in ("jit", "loop")
        for n in (8, 64)
        for impl in ("mpi4py", "jaxcomm")
    ]
    path = tmp_path / "plot.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="needs matplotlib"):
            plots.plot(str(path), records, "test")
    else:
        plots.plot(str(path), records, "test")
        assert path.read_bytes()[:4] == b"\x89PNG"
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(RuntimeError, match="needs matplotlib"):
        plots.plot(str(path), records, "test")


COMMANDS = [
    "compare",
    "eager_memory",
    "gpu",
    "model",
    "nan_minmax",
    "neighbor",
    "overlap",
    "ranks",
    "scaling",
    "soak",
    "user_timing",
]


@pytest.mark.parametrize("name", COMMANDS)
def test_commands_are_modules_that_import_without_side_effects(name):
    module = importlib.import_module(f"benchmarks.{name}")
    assert callable(module.main) and module.__doc__.split("\n")[0]
    assert f"python -m benchmarks.{name}" in module.__doc__


@spawns_own_mpi
def test_commands_start_with_python_m_from_the_root_on_the_installed_jaxcomm():
    # The root holds a jaxcomm without compiled kernels: the commands must not take it.
    probe = "import benchmarks, jaxcomm; print(jaxcomm.__file__)"
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=environment_without_launcher(PYTHONPATH=""),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert pathlib.Path(done.stdout.strip()).resolve().parent != ROOT / "jaxcomm", done.stdout
    # Each command in a process of its own, the processes started together.
    helps = at_once(
        *(
            partial(
                subprocess.run,
                [
                    sys.executable,
                    "-W",
                    "error::RuntimeWarning",
                    "-m",
                    f"benchmarks.{name}",
                    "--help",
                ],
                cwd=ROOT,
                capture_output=True,
                text=True,
                env=environment_without_launcher(PYTHONPATH=""),
                timeout=300,
            )
            for name in COMMANDS
        )
    )
    for name, done in zip(COMMANDS, helps):
        assert done.returncode == 0, (name, done.stderr)
        assert done.stdout.startswith("usage:"), (name, done.stdout)


def test_the_gpu_reference_source_lies_beside_its_module():
    source = gpu.HERE / "gpu_reference.cc"
    assert source.parent == pathlib.Path(gpu.__file__).resolve().parent
    assert "jaxcomm_reference" in source.read_text()


@pytest.mark.mpi
def test_gpu_command_on_cpu_arrays(jc, tmp_path, capsys):
    out = pathlib.Path(jc.comm.bcast(str(tmp_path / "gpu")))
    argv = ["--cpu", "--quick", "--ops", "allreduce", "sendrecv", "--max-bytes", "8", "--out"]
    assert gpu.main([*argv, str(out)]) == 0
    printed = capsys.readouterr().out
    if jc.rank == 0:
        data = json.loads((out / "results.json").read_text())
        assert {(r["op"], r["bytes"]) for r in data["results"]} == {
            ("allreduce", 8),
            ("sendrecv", 8),
        }
        assert all(r["seconds"] > 0 and r["error"] is None for r in data["results"])
        table = (out / "table.md").read_text()
        assert table.startswith("| op | bytes | jaxcomm path | jaxcomm us |")
        assert "| allreduce | 8 B | cpu |" in table and "| 8 B allreduce | us per call |" in table
        assert "results in" in printed


@pytest.mark.mpi
def test_gpu_ragged_layout_agrees_between_senders_and_receivers(jc):
    for n in (jc.size, 4 * jc.size, 1000 * jc.size):
        starts, sends, lands, receives = gpu.ragged_layout(jc.rank, jc.size, n)
        everyone = jc.comm.allgather(sends)
        # What rank j sends here is what this rank expects from j.
        assert [int(everyone[j][jc.rank]) for j in range(jc.size)] == receives.tolist()
        chunk = n // jc.size
        assert starts.tolist() == [j * chunk for j in range(jc.size)]
        assert lands.tolist() == [jc.rank * chunk] * jc.size
        assert all(0 < s <= chunk for s in sends)  # each slice within its share
        if jc.size > 1 and chunk > 1:
            assert len(set(np.concatenate(everyone).tolist())) == 2  # ragged, not uniform


@pytest.mark.mpi
def test_gpu_command_measures_alltoall_and_ragged_on_cpu_arrays(jc, tmp_path):
    out = pathlib.Path(jc.comm.bcast(str(tmp_path / "gpu")))
    size_bytes = 8 * jc.size  # two float32 per rank and share
    argv = ["--cpu", "--quick", "--ops", "alltoall", "ragged", "--sizes", "8", str(size_bytes)]
    assert gpu.main([*argv, "--out", str(out)]) == 0
    if jc.rank == 0:
        data = json.loads((out / "results.json").read_text())
        # 8 B is two float32: one share per rank only on 1 or 2 ranks.
        sizes = sorted({8, size_bytes} if 2 % jc.size == 0 else {size_bytes})
        for op in ("alltoall", "ragged"):
            measured = {r["bytes"] for r in data["results"] if r["op"] == op}
            assert sorted(measured) == sizes, (op, measured)
        assert all(r["seconds"] > 0 and r["error"] is None for r in data["results"])
        table = (out / "table.md").read_text()
        assert f"| ragged | {size_bytes} B | cpu |" in table


def test_gpu_command_says_why_mpi4jax_has_no_columns(tmp_path, monkeypatch):
    """An mpi4jax whose import fails (a build against another jaxlib's FFI) is left out, with why."""
    fake = tmp_path / "mpi4jax"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        'raise RuntimeError("the handler\'s API version (0.5) is incompatible\\nmore")\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "mpi4jax", raising=False)
    functions, why = gpu.mpi4jax_functions(None)
    assert functions is None
    assert why == (
        "mpi4jax failed to load: RuntimeError: the handler's API version (0.5) is incompatible"
    )
    monkeypatch.setitem(sys.modules, "mpi4jax", None)  # not installed
    assert gpu.mpi4jax_functions(None) == (None, "mpi4jax is not installed")


@pytest.mark.mpi
def test_gpu_command_latency_only_on_cpu_arrays(jc, tmp_path):
    out = pathlib.Path(jc.comm.bcast(str(tmp_path / "gpu")))
    hlo = out.parent / f"loop-{jc.rank}.hlo"
    argv = ["--cpu", "--quick", "--latency-only", "--hlo", str(hlo), "--out", str(out)]
    assert gpu.main(argv) == 0
    assert " while(" in hlo.read_text()
    if jc.rank == 0:
        data = json.loads((out / "results.json").read_text())
        assert data["results"] == [] and data["rows"] == []
        loop = data["loop"]
        for name in ("jaxcomm fori_loop: cpu", "empty fori_loop (w + 1 on the device)"):
            assert loop[name] > 0
        table = (out / "table.md").read_text()
        assert table.startswith("| 8 B allreduce | us per call |")


def test_a_scaling_record_keeps_its_requested_size():
    record = {"op": "alltoall", "nbytes": 16, "ranks": 4}
    assert scaling.message_size(record, [8, 1024]) == 8
    assert scaling.message_size({**record, "nbytes": 1024}, [8, 1024]) == 1024
    assert scaling.message_size({"op": "barrier", "nbytes": 0, "ranks": 4}, [8]) == 0


def _json_of_run(command, path, cwd=None):
    """Run ``command`` (a launch that writes JSON to ``path``) in ``cwd``; its JSON and output."""
    done = subprocess.run(
        command,
        cwd=cwd or path.parent,
        capture_output=True,
        text=True,
        env=environment_without_launcher(PYTHONPATH=""),
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(path.read_text()), done.stdout


@spawns_own_mpi
def test_jax_route_beside_the_others_in_one_run(tmp_path):
    # jax.distributed must start before JAX's backends: a launch of its own.
    tiny = ["--sizes", "8", "--repeats", "1", "--time", "0.0001", "--max-iters", "2"]
    ops = "allreduce,allgather,alltoall,reduce_scatter,sendrecv,bcast"
    command = [*mpiexec(2), sys.executable, "-m", "benchmarks.compare", "--ops", ops, *tiny]
    path = tmp_path / "jax.json"
    data, out = _json_of_run([*command, "--no-progress", "--json", str(path)], path, ROOT)
    by_impl = {}
    for record in data["records"]:
        by_impl.setdefault(record["impl"], []).append(record)
    assert {(r["op"], r["mode"]) for r in by_impl["jax"]} == {
        (op, mode)
        for op in ("allreduce", "allgather", "alltoall", "reduce_scatter", "sendrecv")
        for mode in ("jit", "loop")
    }
    # jaxcomm's collectives inside the same shard_map programs, on JaxComm.for_mesh.
    assert {(r["op"], r["mode"]) for r in by_impl["jaxcomm_shard_map"]} == {
        (r["op"], r["mode"]) for r in by_impl["jax"]
    }
    for name in ("jax", "jaxcomm", "c", "mpi4py", "jaxcomm_shard_map"):
        assert all(r["match"] is True and r["time_s"] > 0 for r in by_impl[name]), name
    assert "jaxcomm/jax" in out and "jax/c" in out and "jax/jaxcomm_shard_map" in out
    # jaxlib's MPI collectives need MPItrampoline's wrapper: a line says so.
    path = tmp_path / "jax_mpi.json"
    mpi = ["--ops", "allreduce", "--modes", "jit", "--jax", "mpi", "--json", str(path)]
    data, out = _json_of_run([*command, *mpi], path, ROOT)
    assert "# jax_mpi: not measured: jaxlib's MPI collectives" in out
    assert {r["impl"] for r in data["records"]} - {"mpi4jax"} == {"mpi4py", "jaxcomm", "c"}


@spawns_own_mpi
def test_scaling_runs_each_rank_count_and_marks_oversubscription(tmp_path):
    ranks = [1, 2, 3]
    options = ["--ranks", "1,2,3", "--ops", "allreduce,sendrecv", "--sizes", "8", "--modes", "loop"]
    tiny = ["--", "--repeats", "1", "--time", "0.0001", "--max-iters", "2"]
    command = [sys.executable, "-m", "benchmarks.scaling", *options]
    plot = tmp_path / "scaling.png"
    try:
        import matplotlib  # noqa: F401

        command += ["--plot", str(plot)]
    except ImportError:
        plot = None
    path = tmp_path / "scaling.json"
    data, out = _json_of_run([*command, "--json", str(path), *tiny], path, ROOT)
    busy = [n for n in ranks if n > scaling.cores()]
    assert data["meta"]["oversubscribed"] == busy
    assert [run["ranks"] for run in data["meta"]["runs"]] == ranks
    seen = {(r["ranks"], r["op"], r["impl"]) for r in data["records"]}
    assert seen >= {
        (n, op, impl)
        for n in ranks
        for op in ("allreduce", "sendrecv")
        for impl in ("mpi4py", "jaxcomm", "c")
    }
    assert all(r["match"] is True and r["message"] == 8 for r in data["records"])
    assert all(r["oversubscribed"] == (r["ranks"] in busy) for r in data["records"])
    header = next(line for line in out.splitlines() if line.startswith("op "))
    for n in ranks:
        assert f"{n} rank{'s' if n > 1 else ''}{'*' if n in busy else ''} us" in header
    if plot is not None:
        assert plot.read_bytes()[:4] == b"\x89PNG"


# The cost model (benchmarks.model) ------------------------------------------

KNOWN_FIT = model.Fit(
    transport=model.Transport(latency=2e-6, per_byte=1e-10),
    per_byte_reduced=5e-11,
    cores=2,
    busy_latency=4e-6,
    busy_per_byte=3e-10,
    overhead={"allreduce": 3e-7, "sendrecv": 5e-7, "ragged": 2e-6},
)


def _records_from(fit, ranks):
    """Loop-mode records whose times are what ``fit`` predicts (1 rank: a floor of 1 us)."""
    records = []
    for op in model.MODEL_OPS:
        for size in model.SIZES:
            for p in ranks:
                nbytes = int(
                    np.prod(bench.operations.input_shape(bench.operations.OPS[op], size, p))
                )
                nbytes *= 4
                for impl in (c_floor.FLOOR, model.JAXCOMM):
                    t = model.predict(op, nbytes, p, impl, fit) + (1e-6 if p == 1 else 0.0)
                    records.append(
                        {"op": op, "message": size, "nbytes": nbytes, "ranks": p, "impl": impl}
                        | {"mode": "loop", "time_s": t}
                    )
    return records


def test_the_model_counts_mpich_s_allreduce_rounds():
    unit = model.Transport(latency=1.0, per_byte=0.0)
    # Recursive doubling: log2(p) rounds, and two more exchanges when p is
    # not a power of two.
    assert model.allreduce_time(8, 8, unit, 0.0) == 3
    assert model.allreduce_time(8, 6, unit, 0.0) == 2 + 2
    assert model.allreduce_time(8, 1, unit, 0.0) == 0
    # Reduce-scatter then allgather: 2 log2(p) latencies, 2 (p-1)/p n bytes
    # moved and (p-1)/p n bytes reduced.
    wire = model.Transport(latency=0.0, per_byte=1.0)
    assert model.allreduce_time(4096, 4, wire, 0.0) == 2 * 0.75 * 4096
    assert model.allreduce_time(4096, 4, model.Transport(1.0, 0.0), 0.0) == 4
    assert model.allreduce_time(4096, 4, model.Transport(0.0, 0.0), 1.0) == 0.75 * 4096


def test_the_ragged_exchange_costs_a_message_per_peer_each_way():
    unit = model.Transport(latency=1.0, per_byte=0.0)
    assert model.ragged_time(1024, 16, unit, 0.0) == 2 * 15
    # The bench's counts: whole blocks to even-distance peers, half to the
    # others; rank 0 keeps its own whole block.
    assert model.ragged_sent_bytes(4 * 4 * 8, 4) == (4 * (4 + 8 + 4), 4 * 8)
    copy = model.Transport(latency=0.0, per_byte=0.0)
    assert model.ragged_time(4 * 4 * 8, 4, copy, 1.0) == 4 * 8


def test_the_model_recovers_its_parameters_and_predicts_what_it_was_built_from():
    ranks = [1, 2, 4, 8, 16]
    records = _records_from(KNOWN_FIT, ranks)
    fit = model.calibrate(records, 2)
    assert fit.transport.latency == pytest.approx(KNOWN_FIT.transport.latency)
    assert fit.transport.per_byte == pytest.approx(KNOWN_FIT.transport.per_byte)
    assert fit.per_byte_reduced == pytest.approx(KNOWN_FIT.per_byte_reduced)
    assert fit.busy_latency == pytest.approx(KNOWN_FIT.busy_latency)
    assert fit.busy_per_byte == pytest.approx(KNOWN_FIT.busy_per_byte)
    assert fit.overhead == pytest.approx(KNOWN_FIT.overhead)
    rows = model.check(records, fit, first_busy=4)
    assert {(c["ranks"], c["route"]) for c in rows} == {
        (p, route) for p in ranks[1:] for route in (c_floor.FLOOR, model.JAXCOMM)
    }
    assert all(c["ratio"] == pytest.approx(1.0) for c in rows)
    assert any(not c["calibration"] for c in rows)
    assert model.worst_ratio(rows, oversubscribed=True) == pytest.approx(1.0)
    # A measurement twice as slow as predicted shows as a factor of 2.
    slow = [dict(r, time_s=2 * r["time_s"]) if r["ranks"] == 8 else r for r in records]
    assert model.worst_ratio(model.check(slow, fit, 4), oversubscribed=True) == pytest.approx(2.0)


def test_the_model_command_reads_measurements_and_predicts_many_nodes(tmp_path, capsys):
    path = tmp_path / "measured.json"
    data = {"meta": {"cores": 2}, "records": _records_from(KNOWN_FIT, [1, 2, 4, 8])}
    path.write_text(json.dumps(data))
    out_path = tmp_path / "model.json"
    assert model.main(["--measured", str(path), "--json", str(out_path)]) == 0
    out = capsys.readouterr().out
    assert "worst prediction oversubscribed: within a factor 1.00" in out
    header = next(line for line in out.splitlines() if line.startswith("op ") and "16384" in line)
    assert "64 ranks us" in header and "1024 ranks us" in header
    written = json.loads(out_path.read_text())
    predictions = written["network"]["predictions"]
    small = {c["ranks"]: c for c in predictions if (c["op"], c["message"]) == ("allreduce", 8)}
    # log2(p) rounds of 1 us each on the assumed network, plus jaxcomm's cost.
    assert small[1024]["floor_s"] == pytest.approx(10 * (1e-6 + 8 * (1 / 12e9 + 5e-11)))
    assert small[1024]["jaxcomm_s"] == pytest.approx(small[1024]["floor_s"] + 3e-7)
