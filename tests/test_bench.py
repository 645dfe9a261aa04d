"""Tests for the benchmark that ships in the package (jaxcomm.bench): its
measurement core, its command line and the C floor it builds at run time.
(The source checkout's research benchmarks: tests/test_benchmarks.py.)

Tiny sizes and repeats: these check that every op is measured, checked
against mpi4py and reported, never how fast anything is.
"""

import ctypes
import dataclasses
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import time
import types

import jax
import mpi4py
import numpy as np
import pytest
from conftest import environment_without_launcher, spawns_own_mpi
from mpi4py import MPI

from jaxcomm import _malloc, _runtime, bench
from jaxcomm.bench import native, quiet, report
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
    "call_s",
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
                # Whole calls: the differenced loop figure leaves each call's own cost out.
                assert record.call_s > 0, record
                if mode != "loop":
                    assert record.call_s == pytest.approx(record.time_s), record
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


def test_the_table_shows_whole_calls_beside_the_differenced_loop_figure():
    def rec(impl, mode, us, call_us):
        return bench.Record("allreduce", mode, 8, impl, 2, time_s=us * 1e-6, call_s=call_us * 1e-6)

    records = [
        rec("mpi4py", "loop", 1.0, 1.0),
        rec("jaxcomm", "loop", 1.5, 6.0),  # each jitted call's own cost, spread over its ops
        rec("mpi4py", "jit", 2.0, 2.0),
        rec("jaxcomm", "jit", 8.0, 8.0),
    ]
    records[1].ratios, records[3].ratios = {"mpi4py": 1.5}, {"mpi4py": 4.0}
    text = bench.table(records, ["mpi4py", "jaxcomm"], [("jaxcomm", "mpi4py")], markdown=True)
    lines = text.splitlines()
    assert lines[0] == (
        "| op | size | mode | mpi4py us | jaxcomm us | jaxcomm/mpi4py "
        "| mpi4py call us | jaxcomm call us | jaxcomm/mpi4py call |"
    )
    assert lines[2] == "| allreduce | 8 B | loop | 1 | 1.5 | 1.50 | 1 | 6 | 6.00 |"
    assert lines[3] == "| allreduce | 8 B | jit | 2 | 8 | 4.00 | 2 | 8 | 4.00 |"


def test_json_is_written_by_one_writer(tmp_path):
    record = bench.Record("allreduce", "jit", 8, "jaxcomm", 2, 1, 1, time_s=1e-6, match=True)
    path = tmp_path / "bench.json"
    bench.write_json(str(path), [record], {"ranks": 2})
    text = path.read_text()
    assert text.endswith("}\n")
    assert json.loads(text) == {"meta": {"ranks": 2}, "records": [dataclasses.asdict(record)]}


# What the package holds: the measurement core and this command; the research
# benchmarks are the source checkout's benchmarks/ (tests/test_benchmarks.py).
RESEARCH = [
    "compare",
    "gpu",
    "model",
    "ranks",
    "scaling",
    "soak",
    "neighbor",
    "overlap",
    "routes.jax_shard_map",
    "routes.mpi4jax_functions",
]


@pytest.mark.parametrize("name", RESEARCH)
def test_the_package_holds_no_research_benchmark(name):
    assert importlib.util.find_spec(f"jaxcomm.bench.{name}") is None


@spawns_own_mpi
def test_the_command_starts_with_python_m(tmp_path):
    # From a directory without the source tree: the installed package runs.
    done = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-m", "jaxcomm.bench", "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=environment_without_launcher(PYTHONPATH=""),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage:")
    for option in ("--quick", "--json", "--no-progress", "--no-floor", "--again"):
        assert option in done.stdout
    assert "--plot" not in done.stdout and "--jax" not in done.stdout


@pytest.mark.mpi
def test_native_code_is_built_once_with_the_mpi_compiler_and_loaded_on_every_rank(jc, tmp_path):
    folder = pathlib.Path(jc.comm.bcast(str(tmp_path)))
    source = folder / "size_of.c"
    if jc.rank == 0:
        source.write_text(
            "#include <mpi.h>\n\n#include <stdint.h>\n\n"
            "int size_of(int64_t handle) {\n"
            "  int size = -1;\n"
            "  MPI_Comm_size(MPI_Comm_f2c(handle), &size);\n"
            "  return size;\n"
            "}\n"
        )
    jc.comm.Barrier()
    build_dir = str(folder / "build")
    compiler = native.mpi_cc()

    def build():
        return native.build_shared(source, compiler, [], build_dir)

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


@pytest.mark.parametrize("family", ["mpich", "openmpi", "mpiabi"])
def test_the_standard_abi_s_floor_is_built_by_its_own_wrapper(family, tmp_path, monkeypatch):
    # The mpich wheel's bin/ holds mpicc (MPICH's own ABI) and mpicc_abi (the
    # MPI-5 standard ABI): a floor built by the other one loaded a second MPI
    # into the process, and its first call crashed.
    for name in ("mpicc", "mpicc_abi"):
        (tmp_path / name).write_text("#!/bin/sh\n")
        (tmp_path / name).chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setattr(mpi4py, "get_config", lambda: {})
    monkeypatch.setattr("jaxcomm.build_info", lambda: {"mpi_abi": family})
    wrapper = "mpicc_abi" if family == "mpiabi" else "mpicc"
    assert native.mpi_cc() == [str(tmp_path / wrapper)]


@pytest.mark.mpi
def test_a_floor_of_another_abi_is_refused_with_one_line(jc, monkeypatch):
    # The version line cannot tell MPICH's own ABI from the standard ABI of the
    # same MPICH: the size of a communicator handle does.
    def floor(*args):
        raise AssertionError("a floor of another ABI was called")

    def comm_size():
        return MPI._sizeof(MPI.Comm) + 4

    other = types.SimpleNamespace(jaxcomm_floor=floor, jaxcomm_floor_comm_size=comm_size)
    monkeypatch.setattr(c_floor, "load_on_every_rank", lambda comm, build: (other, None))
    monkeypatch.setattr(c_floor, "_library_version", lambda lib: MPI.Get_library_version())
    lib, why = c_floor.load_floor(jc.comm)
    assert lib is None
    assert why.startswith("mpicc's MPI ABI is not mpi4py's") and "mpicc_abi" in why


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
