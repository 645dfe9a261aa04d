"""The timeline recorder (jaxcomm.trace, JAXCOMM_TRACE) and its merge and summary.

Programs with a planted imbalance (one rank late to a collective, a late
sender) must give the spans, waits and culprit ranks the plan says; a job
whose rank was killed must leave files that still merge; tracing must not
change any result.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_job, spawns_own_mpi
from mpi4py import MPI

import jaxcomm
import jaxcomm.compat.mpi4jax as mpi4jax
from jaxcomm import JaxComm
from jaxcomm.trace import analysis, flush, recording, start, stop

EMULATED = os.environ.get("JAXCOMM_EMULATE_CUDA", "") not in ("", "0")
# A planted delay, and how much of it a wait must show (the rest covers
# oversubscribed ranks' scheduling and the clock alignment).
DELAY = 0.3
SEEN = 0.2e9


@pytest.fixture
def recording_dir():
    """A directory every rank shares, removed afterwards."""
    world = MPI.COMM_WORLD
    path = world.bcast(tempfile.mkdtemp(prefix="jaxcomm-trace-") if world.rank == 0 else None)
    yield path
    world.Barrier()
    if world.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


def _line(text):
    """The line of this file that ends with the comment ``text`` (once)."""
    with open(__file__) as f:
        (line,) = [i for i, source in enumerate(f, 1) if source.rstrip().endswith(text)]
    return line


def _spans(trace, rank, name):
    return [s for s in trace.spans[rank] if s.name == name]


@pytest.mark.mpi
def test_the_rank_late_to_a_collective_is_named(recording_dir):
    jc = JaxComm(MPI.COMM_WORLD)
    step = jax.jit(lambda x: jc.allreduce(x))  # site: late collective
    x = jnp.arange(3.0)
    step(x).block_until_ready()  # compiled before the recording
    with jaxcomm.trace(recording_dir):
        for late in range(jc.size):
            if jc.rank == late:
                time.sleep(DELAY)
            step(x).block_until_ready()
    trace = analysis.load(recording_dir)
    assert sorted(trace.files) == list(range(jc.size))
    site = f"{__file__}:{_line('# site: late collective')}"
    for rank in range(jc.size):
        spans = _spans(trace, rank, "allreduce")
        assert len(spans) == jc.size
        assert all(s.site.startswith(site) and s.bytes == 3 * x.dtype.itemsize for s in spans)
        assert all(s.comm[0] == tuple(range(jc.size)) for s in spans)
    instances = analysis.collective_instances(trace)
    assert len(instances) == jc.size
    for late, instance in enumerate(instances):
        waits, culprit = analysis.late_arrivals(instance)
        assert culprit == late
        assert waits[late] == 0
        for rank in range(jc.size):
            if rank != late:
                assert waits[rank] >= SEEN, (late, rank, waits)
    summary = analysis.summarize(trace)
    row = summary["ops"]["allreduce"]
    assert row["calls"] == jc.size * jc.size
    if jc.size > 1:
        assert set(row["culprits"]) == {str(r) for r in range(jc.size)}
        assert row["wait_ns"] >= SEEN * (jc.size - 1) * jc.size
        for rank in map(str, range(jc.size)):
            ranks = summary["ranks"][rank]
            assert ranks["waiting_ns"] >= SEEN * (jc.size - 1)
            assert ranks["complete"]


@pytest.mark.mpi(min_size=2)
def test_a_late_sender_is_named(recording_dir):
    jc = JaxComm(MPI.COMM_WORLD)
    x = jnp.arange(5, dtype=jnp.int32)
    # Compiled (and the connection made) before the recording.
    if jc.rank == 0:
        jc.send(x, dest=1, tag=3)
        jc.wait(jc.isend(x, dest=1, tag=4))
    elif jc.rank == 1:
        jc.recv(x, source=0, tag=3)
        jc.wait(jc.irecv(x, source=0, tag=4))
    with jaxcomm.trace(recording_dir):
        if jc.rank == 0:
            time.sleep(DELAY)
            jc.send(x, dest=1, tag=3)  # site: late send
            time.sleep(DELAY)
            jc.wait(jc.isend(x, dest=1, tag=4))
        elif jc.rank == 1:
            received = jc.recv(x, source=0, tag=3)
            request = jc.irecv(x, source=0, tag=4)
            later = jc.wait(request)
    if jc.rank == 1:
        np.testing.assert_array_equal(received, x)
        np.testing.assert_array_equal(later, x)
    trace = analysis.load(recording_dir)
    (send,) = _spans(trace, 0, "send")
    (receive,) = _spans(trace, 1, "recv")
    assert send.site.startswith(f"{__file__}:{_line('# site: late send')}")
    assert (send.dest, send.tag, send.bytes) == (1, 3, 20)
    assert (receive.source, receive.recvtag, receive.recv_bytes) == (0, 3, 20)
    assert receive.duration >= SEEN
    matched = analysis.messages(trace)
    assert [(s.rank, r.rank, s.tag) for s, r, _ in matched] == [(0, 1, 3), (0, 1, 4)]
    late_sender, late_receiver = analysis.p2p_waits(send, receive)
    assert late_sender >= SEEN and late_receiver == 0
    # The nonblocking receive: its start returns at once, its wait blocks
    # until the late message is there, and the message flows to the wait.
    (start,) = _spans(trace, 1, "irecv")
    (wait,) = _spans(trace, 1, "wait irecv")
    assert start.kind == "start" and wait.kind == "wait" and start.request == wait.request
    # An eager wait runs a function compiled at the first eager wait of the
    # process, whose call site it keeps (another test's, in a suite run).
    assert wait.site != "?"
    (isend,) = _spans(trace, 0, "isend")
    assert wait.end >= isend.start
    assert wait.duration >= isend.start - wait.start - 1e6
    assert matched[1][2] == wait
    summary = analysis.summarize(trace)
    assert summary["ops"]["recv"]["late_sender_ns"] >= SEEN
    assert list(summary["ops"]["recv"]["culprits"]) == ["0"]
    assert summary["ranks"]["1"]["waiting_ns"] >= SEEN
    events = analysis.chrome_trace(trace)["traceEvents"]
    flows = [e for e in events if e["ph"] in ("s", "f")]
    assert [(e["ph"], e["tid"]) for e in flows] == [("s", 0), ("f", 1), ("s", 0), ("f", 1)]


def _program(jc, x):
    """Several operations in one jitted program, a loop of them included."""

    def body(i, y):
        y = jc.allreduce(y) / jc.size
        return jc.sendrecv(y, y, source=(jc.rank - 1) % jc.size, dest=(jc.rank + 1) % jc.size) + i

    @jax.jit
    def run(x):
        y = jax.lax.fori_loop(0, 4, body, x)
        return jc.bcast(y, root=0), jc.allgather(y), jc.scan(x)

    return run(x)


@pytest.mark.mpi
def test_tracing_changes_no_result_and_loops_record_each_iteration(recording_dir):
    jc = JaxComm(MPI.COMM_WORLD)
    x = jnp.arange(6.0) + jc.rank
    plain = _program(jc, x)
    with jaxcomm.trace(recording_dir):
        traced = _program(jc, x)
        jax.block_until_ready(traced)
    for a, b in zip(plain, traced):
        np.testing.assert_array_equal(a, b)
    trace = analysis.load(recording_dir)
    for rank in range(jc.size):
        names = [s.name for s in trace.spans[rank] if s.kind != "copy"]
        assert names == ["allreduce", "sendrecv"] * 4 + ["bcast", "allgather", "scan"]
    summary = analysis.summarize(trace)
    assert summary["ops"]["allreduce"]["calls"] == 4 * jc.size
    assert summary["ops"]["allreduce"]["bytes"] == 4 * jc.size * 6 * x.dtype.itemsize


@pytest.mark.mpi
def test_eager_calls_and_the_compat_module_record_their_own_sites(recording_dir):
    jc = JaxComm(MPI.COMM_WORLD)
    x = jnp.ones(2)
    with jaxcomm.trace(recording_dir):
        jc.allreduce(x)  # site: eager one
        jc.allreduce(x)  # site: eager two
        mpi4jax.allreduce(x, op=MPI.SUM)  # site: compat
        jaxcomm.sync()
    trace = analysis.load(recording_dir)
    for rank in range(jc.size):
        sites = [s.site for s in _spans(trace, rank, "allreduce")]
        lines = [_line(f"# site: {name}") for name in ("eager one", "eager two", "compat")]
        assert len(sites) == 3
        for site, line in zip(sites, lines):
            assert site.startswith(f"{__file__}:{line} ")


@pytest.mark.mpi
@pytest.mark.skipif(not EMULATED, reason="needs the CUDA kernels (JAXCOMM_EMULATE_CUDA=1)")
def test_staging_copies_are_spans_of_their_own(recording_dir):
    jc = JaxComm(MPI.COMM_WORLD)
    x = jnp.ones(1000)
    with jaxcomm.trace(recording_dir):
        jc.allreduce(x).block_until_ready()
    trace = analysis.load(recording_dir)
    cuda_aware = jaxcomm.cuda_info().get("cuda_aware", False)
    for rank in range(jc.size):
        (call,) = _spans(trace, rank, "allreduce")
        copies = _spans(trace, rank, "copy allreduce")
        if cuda_aware:
            assert copies == []
        else:
            assert copies and all(c.bytes == x.nbytes for c in copies)
            assert all(c.comm == call.comm for c in copies)
            assert all(call.start <= c.start <= c.end <= call.end for c in copies)


@pytest.mark.mpi
def test_one_recording_at_a_time(recording_dir):
    with jaxcomm.trace(recording_dir):
        assert recording()
        jaxcomm.JaxComm(MPI.COMM_WORLD).barrier()
        jaxcomm.sync()
        flush()
        path = os.path.join(recording_dir, f"rank{MPI.COMM_WORLD.rank:05d}.bin")
        records, cut = analysis.read_records(path)
        assert not cut and "barrier" in {op.decode() for op in records["op"]}
        with pytest.raises(RuntimeError, match="already recording"):
            start(recording_dir)
    assert not recording()
    with pytest.raises(RuntimeError, match="nothing is being recorded"):
        stop()


def test_a_cut_record_file_reads_up_to_its_last_whole_record(tmp_path):
    records = np.zeros(3, analysis.RECORD)
    records["end_ns"] = [10, 20, 30]
    path = tmp_path / "rank00000.bin"
    header = b"JCTRACE\0" + np.array([1, analysis.RECORD.itemsize], "<u4").tobytes()
    path.write_bytes(header + records.tobytes()[:-7])
    read, cut = analysis.read_records(path)
    assert cut and list(read["end_ns"]) == [10, 20]
    path.write_bytes(b"not a trace")
    with pytest.raises(ValueError, match="not a jaxcomm trace file"):
        analysis.read_records(path)


@spawns_own_mpi
def test_a_killed_rank_leaves_files_that_merge(tmp_path):
    out = tmp_path / "recording"
    script = """
    import os, signal, sys, time
    import jax.numpy as jnp
    from mpi4py import MPI
    import jaxcomm
    jc = jaxcomm.JaxComm(MPI.COMM_WORLD)
    x = jnp.ones(4)
    for _ in range(20):
        x = jc.allreduce(x) / jc.size
    x.block_until_ready()
    # No flush: the next call finds the ring's oldest span over half a
    # second old and writes the ring.
    time.sleep(0.6)
    x = jc.allreduce(x).block_until_ready()
    sys.stdout.write("flushed\\n")
    sys.stdout.flush()
    if jc.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    jc.allreduce(x).block_until_ready()
    """
    done, _ = run_job(tmp_path, script, ranks=2, limit=120, JAXCOMM_TRACE=str(out))
    assert done.returncode != 0
    assert done.stdout.count("flushed") == 2, done.stdout + done.stderr
    trace = analysis.load(str(out))
    assert sorted(trace.files) == [0, 1]
    assert trace.files[1].end is None
    for rank in (0, 1):
        assert len(_spans(trace, rank, "allreduce")) >= 21
    assert len(analysis.collective_instances(trace)) >= 21
    with open(out / "rank00001.bin", "ab") as f:
        f.write(b"\1" * 50)  # a record cut by the kill
    merged = subprocess.run(
        [sys.executable, "-m", "jaxcomm.trace", str(out)],
        capture_output=True,
        text=True,
        cwd="/",
        timeout=120,
    )
    assert merged.returncode == 0, merged.stderr
    assert "allreduce" in merged.stdout and "1 (cut)" in merged.stdout
    assert (out / "trace.json").stat().st_size > 0
    assert (out / "summary.md").read_text().startswith("**Per rank")


@spawns_own_mpi
def test_shard_map_programs_record(tmp_path):
    out = tmp_path / "recording"
    script = """
    import sys
    import jaxcomm
    from mpi4py import MPI
    jaxcomm.initialize_jax_distributed()
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from jaxcomm import JaxComm
    mesh = Mesh(np.array(jax.devices()), ("x",))
    jc = JaxComm.for_mesh(mesh, "x")
    size = MPI.COMM_WORLD.size
    reduce = lambda u: jc.allreduce(u)  # a call site in this file
    program = jax.jit(jax.shard_map(reduce, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    x = jax.make_array_from_callback(
        (size, 3), NamedSharding(mesh, P("x")), lambda i: np.ones((size, 3), np.float32)[i]
    )
    with jaxcomm.trace(sys.argv[1]):
        for _ in range(3):
            program(x).block_until_ready()
    sys.stdout.write("done\\n")
    """
    done, _ = run_job(tmp_path, script, str(out), ranks=2, limit=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    trace = analysis.load(str(out))
    for rank in (0, 1):
        spans = _spans(trace, rank, "allreduce")
        assert len(spans) == 3 and all(s.bytes == 12 for s in spans)
        assert all("job.py:" in s.site for s in spans), [s.site for s in spans]
    assert len(analysis.collective_instances(trace)) == 3


def _span(rank, op, start, end, **fields):
    values = dict(
        kind="call",
        site="s",
        comm=((0, 1, 2), 1),
        bytes=8,
        recv_bytes=0,
        dest=None,
        source=None,
        tag=0,
        recvtag=0,
        request=-1,
        failed=False,
    )
    values.update(fields)
    return analysis.Span(rank=rank, op=op, start=start, end=end, **values)


def test_the_wait_definitions():
    # Late arrival: each rank waits for the last to start, at most its own time.
    instance = {
        0: _span(0, "bcast", 0, 100),
        1: _span(1, "bcast", 30, 100),
        2: _span(2, "bcast", 90, 100),
    }
    assert analysis.late_arrivals(instance) == ({0: 90, 1: 60, 2: 0}, 2)
    # Late sender: the receive waited from its start to the send's.
    send = _span(0, "send", 50, 60, dest=1)
    receive = _span(1, "recv", 10, 70, source=0)
    assert analysis.p2p_waits(send, receive) == (40, 0)
    # Late receiver: a send that could not finish before its receive was posted.
    send = _span(0, "send", 0, 80, dest=1)
    receive = _span(1, "recv", 50, 85, source=0)
    assert analysis.p2p_waits(send, receive) == (0, 50)
    # A sendrecv waiting for its partner is the partner's late send only.
    first = _span(0, "sendrecv", 0, 80, dest=1, source=1)
    second = _span(1, "sendrecv", 50, 85, dest=0, source=0)
    assert analysis.p2p_waits(first, second) == (0, 0)
    assert analysis.p2p_waits(second, first) == (50, 0)
