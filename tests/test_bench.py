"""Tests for the benchmark package (jaxcomm.bench): its measurement core, its
command line and the commands of its modules.

Tiny sizes and repeats: these check that every op is measured, checked
against mpi4py and reported, never how fast anything is.
"""

import ctypes
import dataclasses
import importlib
import json
import os
import pathlib
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from conftest import environment_without_launcher, mpiexec, spawns_own_mpi

from jaxcomm import _malloc, _runtime, bench
from jaxcomm.bench import gpu, model, native, quiet, report, scaling
from jaxcomm.bench.routes import c_floor

FIELDS = {
    "op",
    "mode",
    "nbytes",
    "impl",
    "ranks",
    "iters",
    "repeats",
    "time_s",
    "min_s",
    "bandwidth",
    "match",
    "ratios",
    "error",
}
TINY = {"repeats": 2, "target_s": 1e-4, "max_iters": 4}


def expected_ops(size):
    return [name for name, op in bench.OPS.items() if op.min_size <= size]


@pytest.fixture(scope="module")
def records(jc):
    impls = [bench.Mpi4pyImpl(jc.comm), bench.JaxcommImpl(jc), bench.PlainJitImpl(jc.size)]
    return bench.run(jc.comm, impls, sizes=[8], **TINY)


class WrongAllreduce(bench.JaxImpl):
    """An allreduce that adds one too many: fast and wrong."""

    name = "wrong"

    def __init__(self, jc):
        self.jc = jc

    def supports(self, op, mode):
        return op.name == "allreduce" and mode in self.modes

    def function(self, op):
        return lambda x: self.jc.allreduce(x) + 1


class Failing(bench.JaxImpl):
    """An implementation whose op raises while tracing."""

    name = "failing"

    def function(self, op):
        def fail(x):
            raise RuntimeError("no such op here")

        return fail


@pytest.mark.mpi
def test_every_op_and_mode_measured_and_checked(jc, records):
    found = {(r.op, r.mode, r.impl): r for r in records}
    for record in records:
        assert set(dataclasses.asdict(record)) == FIELDS
        assert record.ranks == jc.size
    for name in expected_ops(jc.size):
        op = bench.OPS[name]
        for mode in bench.MODES:
            mine, ref = found[(name, mode, "jaxcomm")], found[(name, mode, bench.REFERENCE)]
            for record in (mine, ref):
                assert record.error is None, record
                assert record.match is True, record
                assert record.time_s > 0 and 0 < record.min_s <= record.time_s, record
                assert 1 <= record.iters <= TINY["max_iters"] and record.repeats == 2
                assert record.nbytes == (8 if op.sized and not op.split else record.nbytes)
                if op.sized:
                    assert record.nbytes >= 4 and record.bandwidth > 0
                else:
                    assert record.nbytes == 0 and record.bandwidth is None
            assert mine.ratios[bench.REFERENCE] == pytest.approx(mine.time_s / ref.time_s)
            plain = found.get((name, mode, bench.PLAIN))
            if mode == "loop":
                assert plain is None
            else:
                assert plain.match is None and plain.time_s > 0
                assert mine.ratios[bench.PLAIN] == pytest.approx(mine.time_s / plain.time_s)
    assert {r.op for r in records} == set(expected_ops(jc.size))


@pytest.mark.mpi
def test_wrong_result_is_flagged_and_not_timed(jc):
    impls = [bench.Mpi4pyImpl(jc.comm), WrongAllreduce(jc), bench.JaxcommImpl(jc)]
    for mode in bench.MODES:
        records = bench.measure(jc.comm, bench.OPS["allreduce"], 64, mode, impls, **TINY)
        by_impl = {r.impl: r for r in records}
        assert by_impl["wrong"].match is False and by_impl["wrong"].time_s is None
        assert by_impl["jaxcomm"].match is True and by_impl["jaxcomm"].time_s > 0
        assert "wrong" not in by_impl["jaxcomm"].ratios
        text = bench.table(records, ["mpi4py", "wrong"], [("wrong", "mpi4py")])
        assert "WRONG" in text.splitlines()[1]
        assert "WRONG RESULT (not timed): wrong allreduce" in bench.summary(records, [])


@pytest.mark.mpi
def test_failing_impl_is_reported_on_every_rank(jc):
    impls = [bench.Mpi4pyImpl(jc.comm), Failing()]
    (ref, failed) = bench.measure(jc.comm, bench.OPS["bcast"], 8, "jit", impls, **TINY)
    assert ref.time_s > 0
    assert failed.time_s is None and "no such op here" in failed.error


@pytest.mark.mpi
def test_json_and_markdown_output(jc, tmp_path, capsys):
    path = jc.comm.bcast(str(tmp_path / "bench.json"))
    argv = [
        "--ops",
        "allreduce,barrier",
        "--sizes",
        "8,1K",
        "--modes",
        "jit,eager",
        "--repeats",
        "1",
        "--time",
        "0.0001",
        "--json",
        path,
        "--markdown",
        "--no-progress",
    ]
    assert bench.main(argv) == 0
    data = None
    if jc.rank == 0:
        with open(path) as f:
            data = json.load(f)
    data = jc.comm.bcast(data)
    meta = data["meta"]
    assert meta["ranks"] == jc.size and meta["hosts"] and meta["cpu"]
    assert meta["versions"]["jax"] == jax.__version__
    assert {"jaxlib", "mpi4py", "mpi_library", "jaxcomm"} <= set(meta["versions"])
    assert meta["malloc"] == _malloc.in_effect(_runtime.malloc_pad)
    if pathlib.Path("/proc/stat").exists():
        (host,) = meta["quiet"]
        assert host in meta["hosts"]
        assert {"other_cores", "steal_cores", "cpus", "seconds"} == set(meta["quiet"][host])
    keys = {(r["op"], r["nbytes"], r["mode"]) for r in data["records"] if r["impl"] == "jaxcomm"}
    assert keys == {("allreduce", 8, m) for m in ("jit", "eager")} | {
        ("allreduce", 1024, m) for m in ("jit", "eager")
    } | {("barrier", 0, m) for m in ("jit", "eager")}
    assert all(r["match"] in (True, None) and r["time_s"] > 0 for r in data["records"])
    out = capsys.readouterr().out
    if jc.rank == 0:
        assert "| op | size | mode | mpi4py us | jaxcomm us | plain us |" in out
        assert "| allreduce | 1 KiB | eager |" in out
        if meta["quiet"]:
            assert " other processes kept " in out.splitlines()[-1]
    else:
        assert out == ""


def test_the_machine_s_cpu_time_is_read_from_proc_stat(tmp_path):
    stat = tmp_path / "stat"
    hz = os.sysconf("SC_CLK_TCK")
    # user nice system idle iowait irq softirq steal: busy is all but idle,
    # iowait and steal.
    stat.write_text(f"cpu  {hz} {hz} {hz} {50 * hz} {9 * hz} {hz} {hz} {3 * hz} 0 0\ncpu0 ...\n")
    assert quiet.machine_cpu_seconds(str(stat)) == (5.0, 3.0)
    assert quiet.machine_cpu_seconds(str(tmp_path / "none")) is None
    hosts = {"a": {"other_cores": 0.02, "steal_cores": 0.0, "cpus": 2, "seconds": 60.0}}
    hosts["b"] = {"other_cores": 0.98, "steal_cores": 0.0, "cpus": 2, "seconds": 60.0}
    assert [line.split(":")[0] for line in quiet.lines(hosts)] == ["quiet", "NOT QUIET"]
    assert quiet.lines(hosts)[1].endswith(
        "kept 0.98 of 2 cores busy and the hypervisor took "
        "0.00 cores over the 60 s run; the figures competed "
        "with them"
    )


@pytest.mark.mpi
@pytest.mark.skipif(not pathlib.Path("/proc/stat").exists(), reason="no /proc/stat: not Linux")
def test_the_watch_sees_a_process_that_competes_with_the_run(jc):
    # One process spinning for the whole watch, started by one rank per host:
    # it is other work, the ranks' own waiting is not.
    watch = quiet.Watch(jc.comm)
    spinner = None
    if watch.host.rank == 0:
        spinner = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass",
            ]
        )
    end = time.monotonic() + 1.5
    while time.monotonic() < end:
        time.sleep(0.05)
    if spinner is not None:
        spinner.wait()
    hosts = watch.finish()
    for name, w in hosts.items():
        assert w["other_cores"] > 0.5, (name, w)
        assert 1.4 < w["seconds"] < 30, (name, w)


def test_sizes_parse_and_print():
    assert [bench.parse_size(s) for s in ("8", "4K", "4KiB", "64MiB", "1m")] == [
        8,
        4096,
        4096,
        64 << 20,
        1 << 20,
    ]
    with pytest.raises(Exception, match="not a size"):
        bench.parse_size("8 bytes")
    assert bench.sizes_between(8, 4096) == [8, 64, 512, 4096]
    assert bench.sizes_between(8, 1000) == [8, 64, 512, 1000]
    assert [bench.format_size(n) for n in (8, 4096, 64 << 20, 1000)] == [
        "8 B",
        "4 KiB",
        "64 MiB",
        "1000 B",
    ]
    assert bench.DEFAULT_SIZES[0] == 8 and bench.DEFAULT_SIZES[-1] == 64 << 20


def test_input_shapes_follow_the_message_size():
    assert bench.input_shape(bench.OPS["allreduce"], 1024, 3) == (256,)
    assert bench.input_shape(bench.OPS["alltoall"], 1024, 4) == (4, 64)
    assert bench.input_shape(bench.OPS["scatter"], 8, 3) == (3, 1)
    assert bench.input_shape(bench.OPS["barrier"], 1024, 2) == (1,)


def test_loop_step_is_the_same_in_jax_and_numpy():
    for out_shape, carry_shape in [((4,), (4,)), ((2, 4), (4,)), ((4,), (2, 4))]:
        out = np.arange(np.prod(out_shape), dtype=np.float32).reshape(out_shape)
        carry = np.ones(carry_shape, np.float32)
        expected = np.asarray(bench.loop_step(jax.numpy.asarray(out), carry))
        bench.loop_step_numpy(out, carry)
        np.testing.assert_array_equal(carry, expected)


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
            bench.plot(str(path), records, "test")
    else:
        bench.plot(str(path), records, "test")
        assert path.read_bytes()[:4] == b"\x89PNG"
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(RuntimeError, match="needs matplotlib"):
        bench.plot(str(path), records, "test")


def test_one_table_printer_for_text_and_markdown():
    header, rows = ["op", "size", "us"], [["allreduce", "8 B", "12.5"], ["bcast", "1 MiB", "7"]]
    assert report.format_table(header, rows, left=2).splitlines() == [
        "op         size     us",
        "allreduce  8 B    12.5",
        "bcast      1 MiB     7",
    ]
    assert report.format_table(header, rows, markdown=True).splitlines() == [
        "| op | size | us |",
        "|---|---|---|",
        "| allreduce | 8 B | 12.5 |",
        "| bcast | 1 MiB | 7 |",
    ]


def test_json_is_written_by_one_writer(tmp_path):
    record = bench.Record("allreduce", "jit", 8, "jaxcomm", 2, 1, 1, time_s=1e-6, match=True)
    path = tmp_path / "bench.json"
    bench.write_json(str(path), [record], {"ranks": 2})
    text = path.read_text()
    assert text.endswith("}\n")
    assert json.loads(text) == {"meta": {"ranks": 2}, "records": [dataclasses.asdict(record)]}


COMMANDS = ["compare", "eager_memory", "gpu", "model", "nan_minmax", "overlap", "scaling", "soak"]


@pytest.mark.parametrize("name", COMMANDS)
def test_commands_are_modules_that_import_without_side_effects(name):
    module = importlib.import_module(f"jaxcomm.bench.{name}")
    assert callable(module.main) and module.__doc__.split("\n")[0]
    assert f"python -m jaxcomm.bench.{name}" in module.__doc__


@spawns_own_mpi
def test_commands_start_with_python_m(tmp_path):
    # From a directory without the source tree: the installed package runs.
    for name in ["", *(f".{c}" for c in COMMANDS)]:
        done = subprocess.run(
            [sys.executable, "-W", "error::RuntimeWarning", "-m", f"jaxcomm.bench{name}", "--help"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            env=environment_without_launcher(PYTHONPATH=""),
            timeout=300,
        )
        assert done.returncode == 0, (name, done.stderr)
        assert done.stdout.startswith("usage:"), (name, done.stdout)


def test_the_gpu_reference_source_ships_beside_its_module():
    # The installed package, not the source tree (see conftest.py).
    source = native.HERE / "gpu_reference.cc"
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


@pytest.mark.mpi
def test_native_code_is_built_once_with_the_mpi_compiler_and_loaded_on_every_rank(jc, tmp_path):
    folder = pathlib.Path(jc.comm.bcast(str(tmp_path)))
    source = folder / "size_of.cc"
    if jc.rank == 0:
        source.write_text(
            "#include <mpi.h>\n\n#include <cstdint>\n\n"
            'extern "C" int size_of(int64_t handle) {\n'
            "  int size = -1;\n"
            "  MPI_Comm_size(MPI_Comm_f2c(handle), &size);\n"
            "  return size;\n"
            "}\n"
        )
    jc.comm.Barrier()
    build_dir = str(folder / "build")
    compiler, flags = native.mpi_cxx()

    def build():
        return native.build_shared(source, compiler, flags, build_dir)

    lib, error = native.load_on_every_rank(jc.comm, build)
    assert error is None
    lib.size_of.argtypes = [ctypes.c_int64]
    assert lib.size_of(jc.comm.py2f()) == jc.size
    assert build() == build() and len(list(pathlib.Path(build_dir).iterdir())) == 1


@pytest.fixture(scope="module")
def floor(jc, tmp_path_factory):
    folder = jc.comm.bcast(str(tmp_path_factory.mktemp("floor")) if jc.rank == 0 else None)
    lib, error = c_floor.load_floor(jc.comm, folder)
    assert error is None, error
    return c_floor.CFloorImpl(jc.comm, lib)


def test_the_c_floor_source_ships_beside_its_module():
    # The installed package, not the source tree (see conftest.py).
    assert c_floor.SOURCE.parent == pathlib.Path(c_floor.__file__).resolve().parent
    assert c_floor.SOURCE.suffix == ".c" and "jaxcomm_floor(" in c_floor.SOURCE.read_text()


@pytest.mark.mpi
def test_the_c_floor_does_every_op_and_mode_as_mpi4py(jc, floor):
    reference = bench.Mpi4pyImpl(jc.comm)
    records = bench.run(jc.comm, [reference, floor], sizes=[8, 1024], **TINY)
    found = {(r.op, r.nbytes, r.mode, r.impl): r for r in records}
    mine = [r for r in records if r.impl == c_floor.FLOOR]
    assert {(r.op, r.mode) for r in mine} == {
        (name, mode) for name in expected_ops(jc.size) for mode in bench.MODES
    }
    for record in mine:
        assert record.error is None and record.match is True, record
        assert record.time_s > 0 and record.iters >= 1, record
        ref = found[(record.op, record.nbytes, record.mode, bench.REFERENCE)]
        assert record.ratios[bench.REFERENCE] == pytest.approx(record.time_s / ref.time_s)
    # Several loop iterations: each result, halved, is the next input, as in NumPy.
    for name in expected_ops(jc.size):
        op = bench.OPS[name]
        x = bench.check_data(bench.input_shape(op, 64, jc.size), jc.rank)
        for mode in ("loop", "jit"):
            want = reference.runner(op, mode, x)(3)
            got = floor.runner(op, mode, x)(3)
            if want is None:
                assert got is None, name
            else:
                np.testing.assert_array_equal(got, want, err_msg=f"{name} {mode}")


@pytest.mark.mpi
def test_the_floor_is_skipped_with_one_line_without_mpicc(jc, monkeypatch, capsys):
    def no_mpicc():
        raise RuntimeError("no mpicc: none here")

    monkeypatch.setattr(c_floor, "mpi_cc", no_mpicc)
    argv = ["--ops", "allreduce", "--sizes", "8", "--modes", "jit", "--repeats", "1"]
    assert bench.main([*argv, "--time", "0.0001", "--no-progress"]) == 0
    out = capsys.readouterr().out
    if jc.rank == 0:
        assert out.splitlines()[0] == "# c: the C floor is skipped: no mpicc: none here"
        assert " c us" not in out and "jaxcomm/c" not in out
    else:
        assert out == ""


@pytest.mark.mpi
def test_the_table_reads_every_route_against_the_floor(jc, floor, capsys):
    argv = ["--ops", "allreduce,barrier", "--sizes", "8", "--repeats", "1", "--time", "0.0001"]
    assert bench.main([*argv, "--markdown", "--no-progress"]) == 0
    out = capsys.readouterr().out
    if jc.rank == 0:
        header = next(line for line in out.splitlines() if line.startswith("| op |"))
        assert "| plain us | c us |" in header
        assert "| mpi4py/c | jaxcomm/c |" in header
        assert "jaxcomm/c loop :" in out


def test_a_scaling_record_keeps_its_requested_size():
    record = {"op": "alltoall", "nbytes": 16, "ranks": 4}
    assert scaling.message_size(record, [8, 1024]) == 8
    assert scaling.message_size({**record, "nbytes": 1024}, [8, 1024]) == 1024
    assert scaling.message_size({"op": "barrier", "nbytes": 0, "ranks": 4}, [8]) == 0


def _json_of_run(command, path):
    """Run ``command`` (a launch that writes JSON to ``path``); its JSON and output."""
    done = subprocess.run(
        command,
        cwd=path.parent,
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
    command = [*mpiexec(2), sys.executable, "-m", "jaxcomm.bench", "--ops", ops, *tiny]
    path = tmp_path / "jax.json"
    data, out = _json_of_run([*command, "--jax", "--no-progress", "--json", str(path)], path)
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
    data, out = _json_of_run([*command, *mpi], path)
    assert "# jax_mpi: not measured: jaxlib's MPI collectives" in out
    assert {r["impl"] for r in data["records"]} == {"mpi4py", "jaxcomm", "plain", "c"}


@spawns_own_mpi
def test_scaling_runs_each_rank_count_and_marks_oversubscription(tmp_path):
    ranks = [1, 2, 3]
    options = ["--ranks", "1,2,3", "--ops", "allreduce,sendrecv", "--sizes", "8", "--modes", "loop"]
    tiny = ["--", "--repeats", "1", "--time", "0.0001", "--max-iters", "2"]
    command = [sys.executable, "-m", "jaxcomm.bench.scaling", *options]
    plot = tmp_path / "scaling.png"
    try:
        import matplotlib  # noqa: F401

        command += ["--plot", str(plot)]
    except ImportError:
        plot = None
    path = tmp_path / "scaling.json"
    data, out = _json_of_run([*command, "--json", str(path), *tiny], path)
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


def test_goal_misses_name_the_ops_and_sizes_past_the_large_message_goal():
    def rec(impl, op, nbytes, mode, us):
        return bench.Record(op, mode, nbytes, impl, 2, time_s=us * 1e-6)

    records = [
        # loop: 1.05x mpi4py meets the goal, 1.5x misses it.
        rec("mpi4py", "bcast", 1 << 20, "loop", 100),
        rec("jaxcomm", "bcast", 1 << 20, "loop", 105),
        rec("mpi4py", "gather", 1 << 20, "loop", 100),
        rec("jaxcomm", "gather", 1 << 20, "loop", 150),
        # jit: within 1.1x of mpi4py + plain (100 + 50) meets it, 2x misses it.
        rec("mpi4py", "bcast", 4 << 20, "jit", 100),
        rec("plain", "bcast", 4 << 20, "jit", 50),
        rec("jaxcomm", "bcast", 4 << 20, "jit", 160),
        rec("mpi4py", "gather", 4 << 20, "jit", 100),
        rec("plain", "gather", 4 << 20, "jit", 50),
        rec("jaxcomm", "gather", 4 << 20, "jit", 300),
        # Below 64 KiB the goal does not apply.
        rec("mpi4py", "gather", 4096, "loop", 1),
        rec("jaxcomm", "gather", 4096, "loop", 9),
    ]
    assert report.goal_misses(records) == [
        "gather 1 MiB loop: jaxcomm 1.50x mpi4py",
        "gather 4 MiB jit: jaxcomm 2.00x mpi4py + plain",
    ]
    assert "gather 4 MiB jit: jaxcomm 2.00x mpi4py + plain" in report.summary(records, [])


def test_run_noise_reads_each_twin_against_its_first_and_checks_the_goal_again():
    def rec(impl, op, nbytes, mode, us):
        return bench.Record(op, mode, nbytes, impl, 2, time_s=us * 1e-6)

    records = []
    for nbytes, (m, j, m2, j2) in {
        64 << 10: (100, 100, 100, 100),
        1 << 20: (100, 100, 125, 100),  # the reference 1.25x itself
        4 << 20: (100, 120, 100, 90),  # jaxcomm 0.75x itself; misses once only
        64 << 20: (100, 150, 100, 150),  # misses in both pairs
        4096: (100, 900, 100, 100),  # below 64 KiB: not counted
    }.items():
        records += [
            rec("mpi4py", "bcast", nbytes, "loop", m),
            rec("jaxcomm", "bcast", nbytes, "loop", j),
            rec("mpi4py again", "bcast", nbytes, "loop", m2),
            rec("jaxcomm again", "bcast", nbytes, "loop", j2),
        ]
    assert report.run_noise(records) == [
        "mpi4py again/mpi4py loop : median 1.00, range 1.00-1.25, 1 of 4 beyond 1.1x either way",
        "jaxcomm again/jaxcomm loop : median 1.00, range 0.75-1.00, 1 of 4 beyond 1.1x either way",
    ]
    assert report.goal_misses(records, "jaxcomm again", "mpi4py again") == [
        "bcast 64 MiB loop: jaxcomm again 1.50x mpi4py again"
    ]
    summary = report.summary(records, [])
    assert "(jaxcomm again against mpi4py again): 1 missing\n" in summary
    assert summary.endswith("\nmissing in both checks: bcast 64 MiB loop")
    # Without twins the summary says nothing of noise.
    assert "noise" not in report.summary([r for r in records if "again" not in r.impl], [])


@pytest.mark.mpi
def test_again_times_both_routes_twice_in_one_run(jc, capsys):
    argv = ["--ops", "allreduce", "--sizes", "64K", "--modes", "loop", "--repeats", "1"]
    assert bench.main([*argv, "--time", "0.0001", "--no-progress", "--no-floor", "--again"]) == 0
    out = capsys.readouterr().out
    if jc.rank == 0:
        header = next(line for line in out.splitlines() if line.startswith("op "))
        assert "mpi4py again us" in header and "jaxcomm again us" in header
        assert "mpi4py again/mpi4py" in header and "jaxcomm again/jaxcomm" in header
        assert "  mpi4py again/mpi4py loop : median" in out
        assert "  jaxcomm again/jaxcomm loop : median" in out
    else:
        assert out == ""


# The cost model (jaxcomm.bench.model) ------------------------------------------

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
