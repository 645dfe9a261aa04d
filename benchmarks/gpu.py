"""Latency and bandwidth of jaxcomm on GPU arrays, side by side with references.

Run:  mpiexec -n 2 python -m benchmarks.gpu [--quick] [--out DIR]

For allreduce (float32 sum), bcast (root 0), allgather, sendrecv (a ring),
alltoall and a ragged exchange (ragged_all_to_all of float32, every other
pair of ranks sending half a share), from 8 B to 256 MiB per rank, rank 0
prints the median time of one call and its bandwidth (bytes per rank / time)
for:
  jaxcomm       jax.jit(jc.<op>) on GPU arrays, once per data path jaxcomm
                has here (host staging; cuda-aware where the MPI library is);
                with --pieces, again at each pipeline piece size
  jaxcomm loop  the op in a jitted fori_loop, per iteration
  mpi4jax       jax.jit(mpi4jax.<op>), and in a fori_loop, where mpi4jax is
                installed (it is never a dependency of jaxcomm; it has no
                ragged exchange); its CUDA-aware mode is
                MPI4JAX_USE_CUDA_MPI=1 in the environment
  by hand       jax.device_get + mpi4py on NumPy + jax.device_put
  C++ ref       cudaMemcpyAsync into pinned buffers, the MPI call, and back, in
                C++ (gpu_reference.cc): host staging without pipelining
  C++ direct    the MPI call alone on the device pointers, in C++, where the
                MPI library is CUDA-aware: the floor of the direct path
and, for 8 B, the allreduce in a jitted fori_loop (time per iteration) next
to the same loop in mpi4jax, the C++ reference, an empty loop (XLA's own
cost of an iteration), mpi4py on NumPy, and jaxcomm's handler clock (time
in the handler, and the part of it waiting for the GPU). It prints whether
jaxcomm meets its targets (not asserted) and writes results.csv,
results.json, table.md (rewritten after each op, so that a run cut short keeps
what it measured) and, with matplotlib, bandwidth.png to --out.
--latency-only measures the 8 B loops alone (to compare settings: one rank,
ranks sharing a GPU with and without MPS); --hlo FILE writes the compiled
HLO of jaxcomm's loop.

Without a GPU it says so and exits 0; --cpu measures CPU arrays instead
(no C++ reference), which checks this script anywhere.
"""

import argparse
import csv
import ctypes
import math
import os
import pathlib
import shutil
import sys

import jax
import numpy as np
from mpi4py import MPI

from jaxcomm import (
    JaxComm,
    __version__,
    _runtime,
    bind_local_gpu,
    cuda_info,
    pipeline_bytes,
    set_cuda_aware,
    set_pipeline_bytes,
)
from jaxcomm.bench.native import build_shared, default_build_dir, load_on_every_rank
from jaxcomm.bench.report import dump_json, format_table
from jaxcomm.bench.sizes import format_size, parse_size
from jaxcomm.bench.timing import median_seconds

from .plots import pyplot, save_figure

HERE = pathlib.Path(__file__).resolve().parent

OPS = ("allreduce", "bcast", "allgather", "sendrecv", "alltoall", "ragged")
# Ops that split each rank's operand into one share per rank.
SPLIT = ("alltoall", "ragged")
KIND = {name: code for code, name in enumerate(OPS)}  # gpu_reference.cc's `kind`
MIB = 1 << 20
FULL_SIZES = [8 * 4**k for k in range(13)] + [256 * MIB]  # 8 B .. 128 MiB, 256 MiB
QUICK_SIZES = [8, 2048, 512 * 1024, 16 * MIB, 256 * MIB]
TARGET_FROM = 16 * MIB
# Bandwidth against the unpipelined C++ reference at >= TARGET_FROM, and the
# 8 B loop's time per iteration against the C++ reference's per call.
TARGETS = {"C++ ref": 1.0, "fori_loop": 2.0}
LOOP_STEPS = 20  # iterations of the fori_loop of each op and size


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="five sizes, fewer iterations")
    parser.add_argument("--out", default="gpu_benchmark", help="directory for the results")
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    parser.add_argument("--max-bytes", type=int, default=256 * MIB, help="largest size per rank")
    parser.add_argument(
        "--build-dir",
        default=default_build_dir(),
        help="where gpu_reference.cc is built (once per source and compiler)",
    )
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="measure CPU arrays (no C++ reference), e.g. to check the script",
    )
    parser.add_argument(
        "--sizes", nargs="+", type=parse_size, help="sizes per rank (default: by --quick)"
    )
    parser.add_argument(
        "--pieces",
        nargs="+",
        type=parse_size,
        default=[],
        help="pipeline piece sizes to measure jaxcomm's host staging at, from "
        f"{format_size(TARGET_FROM)} up (0: whole messages)",
    )
    parser.add_argument(
        "--latency-only", action="store_true", help="only the 8 B loops and the handler clock"
    )
    parser.add_argument("--hlo", help="write the compiled HLO of jaxcomm's 8 B loop here")
    parser.add_argument("--label", default="", help="a word on the setting, printed and saved")
    args = parser.parse_args(argv)
    if args.max_bytes < 8:
        parser.error("--max-bytes must be at least 8")
    return args


def sizes_for(args):
    sizes = args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)
    return [s for s in sizes if s <= args.max_bytes]


def fits(op, nbytes, size):
    """Whether ``op`` can move ``nbytes`` per rank of float32 among ``size`` ranks."""
    return nbytes % 4 == 0 and (op not in SPLIT or (nbytes // 4) % size == 0)


def ragged_layout(rank, size, n):
    """The ragged exchange's index arrays for ``n`` float32 rows per rank.

    Rank i sends rank j a slice of ``n // size`` rows, halved where i + j is
    odd, from its j-th share; it lands at share i of rank j's output, whose
    other rows keep their values (gpu_reference.cc's RaggedRows is the same).
    """
    chunk = n // size

    def rows(i, j):
        return chunk - ((i + j) % 2) * (chunk // 2)

    peers = np.arange(size)
    return (
        (peers * chunk).astype(np.int32),
        np.array([rows(rank, j) for j in peers], np.int32),
        np.full(size, rank * chunk, np.int32),
        np.array([rows(j, rank) for j in peers], np.int32),
    )


def iterations_for(nbytes, quick):
    """Timed calls per size: enough to move about 1 GiB (256 MiB with --quick)."""
    budget, low, high = (256 * MIB, 3, 50) if quick else (1024 * MIB, 5, 200)
    return max(low, min(high, budget // nbytes))


def _cell(value, fmt):
    return "-" if value is None or not math.isfinite(value) else format(value, fmt)


def bandwidth(nbytes, seconds):
    """GB/s of ``nbytes`` per rank in ``seconds``, or None."""
    if seconds is None or not math.isfinite(seconds) or seconds <= 0:
        return None
    return nbytes / seconds / 1e9


def ratio(a, b):
    return None if a is None or b is None or not b else a / b


def table_rows(results):
    """One row per (op, size, jaxcomm method): times, bandwidths and ratios."""
    rows = []
    refs = {(r["op"], r["bytes"], r["method"]): r["seconds"] for r in results}
    for r in results:
        if not r["method"].startswith("jaxcomm: "):
            continue
        key = (r["op"], r["bytes"])
        path = r["method"].split(": ", 1)[-1]
        loop = refs.get((*key, f"jaxcomm loop: {path}"))
        cpp, m4j, m4j_loop = (refs.get((*key, m)) for m in ("C++ ref", "mpi4jax", "mpi4jax loop"))
        hand = refs.get((*key, "by hand"))
        direct = refs.get((*key, "C++ direct"))
        rows.append(
            {
                "op": r["op"],
                "bytes": r["bytes"],
                "path": path,
                "jaxcomm_us": _us(r["seconds"]),
                "loop_us": _us(loop),
                "mpi4jax_us": _us(m4j),
                "mpi4jax_loop_us": _us(m4j_loop),
                "by_hand_us": _us(hand),
                "cpp_us": _us(cpp),
                "cpp_direct_us": _us(direct),
                "jaxcomm_gbs": bandwidth(r["bytes"], r["seconds"]),
                "cpp_gbs": bandwidth(r["bytes"], cpp),
                "vs_cpp": ratio(cpp, r["seconds"]),
                "vs_by_hand": ratio(hand, r["seconds"]),
                "vs_mpi4jax": ratio(m4j, r["seconds"]),
                "loop_vs_mpi4jax": ratio(m4j_loop, loop),
            }
        )
    return rows


def _us(seconds):
    return None if seconds is None else seconds * 1e6


# Ratios are speed-ups: the other's time over jaxcomm's (above 1: jaxcomm faster).
COLUMNS = (
    ("jaxcomm us", "jaxcomm_us", ".1f"),
    ("loop us", "loop_us", ".1f"),
    ("mpi4jax us", "mpi4jax_us", ".1f"),
    ("mpi4jax loop us", "mpi4jax_loop_us", ".1f"),
    ("by hand us", "by_hand_us", ".1f"),
    ("C++ ref us", "cpp_us", ".1f"),
    ("C++ direct us", "cpp_direct_us", ".1f"),
    ("jaxcomm GB/s", "jaxcomm_gbs", ".3g"),
    ("C++ ref GB/s", "cpp_gbs", ".3g"),
    ("x C++ ref", "vs_cpp", ".2f"),
    ("x by hand", "vs_by_hand", ".2f"),
    ("x mpi4jax", "vs_mpi4jax", ".2f"),
    ("loop x mpi4jax loop", "loop_vs_mpi4jax", ".2f"),
)


def markdown_table(rows, loop=None):
    """A Markdown table of ``table_rows`` and the 8 B loop comparison."""
    if not rows:
        return loop_table(loop or {})
    text = format_table(
        ["op", "bytes", "jaxcomm path", *(title for title, _, _ in COLUMNS)],
        [
            [r["op"], format_size(r["bytes"]), r["path"]]
            + [_cell(r[key], fmt) for _, key, fmt in COLUMNS]
            for r in rows
        ],
        markdown=True,
    )
    if loop:
        text += "\n\n" + loop_table(loop)
    return text


def loop_table(loop):
    return format_table(
        ["8 B allreduce", "us per call"],
        [[name, _cell(_us(s), ".2f")] for name, s in loop.items()],
        markdown=True,
    )


def check_targets(rows, loop):
    """(verdict, text) lines for the targets; printed, never asserted."""
    checks = []
    staged = [r for r in rows if r["path"].startswith("host staging") and r["bytes"] >= TARGET_FROM]
    goal = TARGETS["C++ ref"]
    for path in dict.fromkeys(r["path"] for r in staged):
        for op in dict.fromkeys(r["op"] for r in staged):
            values = [r["vs_cpp"] for r in staged if (r["op"], r["path"]) == (op, path)]
            values = [v for v in values if v is not None]
            if not values:
                continue
            worst = min(values)
            checks.append(
                (
                    "pass" if worst >= goal else "miss",
                    f"{op}, {path}: >= {goal}x the C++ reference at >= "
                    f"{format_size(TARGET_FROM)}: worst {worst:.2f}x",
                )
            )
    looped = [r for r in rows if r["loop_vs_mpi4jax"] is not None]
    if looped:
        worst = min(looped, key=lambda r: r["loop_vs_mpi4jax"])
        checks.append(
            (
                "pass" if worst["loop_vs_mpi4jax"] >= 1 else "miss",
                "in a loop, at least as fast as mpi4jax at every op and size: worst "
                f"{worst['loop_vs_mpi4jax']:.2f}x ({worst['op']} {format_size(worst['bytes'])}, "
                f"{worst['path']})",
            )
        )
    cpp = (loop or {}).get(LOOP_CPP)
    for name, seconds in (loop or {}).items():
        if not name.startswith("jaxcomm fori_loop") or cpp is None or seconds is None:
            continue
        times = seconds / cpp
        goal = TARGETS["fori_loop"]
        checks.append(
            (
                "pass" if times <= goal else "miss",
                f"8 B {name}: within {goal}x of the C++ reference loop: {times:.2f}x",
            )
        )
    return checks


def write_results(out, results, rows, loop, checks, meta, plot=True):
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["op", "bytes", "method", "seconds", "error"])
        writer.writeheader()
        for r in results:
            writer.writerow({k: r.get(k) for k in writer.fieldnames})
    dump_json(
        out / "results.json",
        {
            "meta": meta,
            "results": results,
            "rows": rows,
            "loop": loop,
            "targets": [{"verdict": v, "text": t} for v, t in checks],
        },
    )
    text = markdown_table(rows, loop)
    if checks:
        text += "\n\nTargets (reported, not asserted):\n\n"
        text += "\n".join(f"- {v.upper()}: {t}" for v, t in checks)
    (out / "table.md").write_text(text + "\n")
    if not results or not plot:
        return None  # --latency-only, or a partial write: nothing to plot
    try:
        plt = pyplot()
    except RuntimeError:
        return None
    ops = list(dict.fromkeys(r["op"] for r in results))
    fig, axes = plt.subplots(1, len(ops), figsize=(4.5 * len(ops), 4), squeeze=False)
    for ax, op in zip(axes[0], ops, strict=True):
        for method in dict.fromkeys(r["method"] for r in results if r["op"] == op):
            points = [
                (r["bytes"], bandwidth(r["bytes"], r["seconds"]))
                for r in results
                if r["op"] == op and r["method"] == method
            ]
            points = [(b, g) for b, g in points if g is not None]
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=method)
        ax.set(xscale="log", yscale="log", title=op, xlabel="bytes per rank", ylabel="GB/s")
    title = f"{meta['ranks']} ranks on {meta['device']}, jax {meta['jax']}"
    save_figure(plt, fig, axes[0][0], title, out / "bandwidth.png")
    return out / "bandwidth.png"


# Measurement -----------------------------------------------------------------


def call_seconds(call, iterations, comm):
    """Median wall time of one ``call()`` (which waits for its result)."""
    return median_seconds(call, iterations, comm, warmup=2, barrier_each=False)


def op_functions(rank, size, allreduce, bcast, allgather, sendrecv, alltoall, ragged=None):
    """The ops from one library's functions, each on a flat array and flat results.

    allgather's and alltoall's results are flat, as jaxcomm's ``tiled=True``;
    ``ragged`` (operand, output, input_offsets, send_sizes, output_offsets,
    recv_sizes) is left out where None.
    """
    right, left = (rank + 1) % size, (rank - 1) % size
    functions = {
        "allreduce": allreduce,
        "bcast": bcast,
        "allgather": lambda v: allgather(v).reshape(-1),
        "sendrecv": lambda v: sendrecv(v, left, right),
        "alltoall": lambda v: alltoall(v).reshape(-1),
    }
    if ragged is not None:

        def exchange(v):
            layout = ragged_layout(rank, size, v.shape[0])
            return ragged(v, jax.numpy.zeros_like(v), *layout)

        functions["ragged"] = exchange
    return functions


def jaxcomm_functions(jc):
    return op_functions(
        jc.rank,
        jc.size,
        lambda v: jc.allreduce(v, op=MPI.SUM),
        lambda v: jc.bcast(v, root=0),
        lambda v: jc.allgather(v, tiled=True),
        lambda v, left, right: jc.sendrecv(v, v, source=left, dest=right),
        lambda v: jc.alltoall(v, tiled=True),
        jc.ragged_all_to_all,
    )


def mpi4jax_functions(comm):
    """mpi4jax's functions on ``comm``, and None; or None and why there are none.

    Its import registers its handlers with this jaxlib, which refuses a build
    made against another jaxlib's FFI version: the benchmark then runs
    without mpi4jax's columns and says why.
    """
    try:
        import mpi4jax
    except ImportError:
        return None, "mpi4jax is not installed"
    except Exception as err:  # noqa: BLE001 (JaxRuntimeError, and whatever a broken build raises)
        first_line = (str(err).strip().splitlines() or [""])[0]
        return None, f"mpi4jax failed to load: {type(err).__name__}: {first_line}"
    size = comm.Get_size()
    functions = op_functions(
        comm.Get_rank(),
        size,
        lambda v: mpi4jax.allreduce(v, op=MPI.SUM, comm=comm),
        lambda v: mpi4jax.bcast(v, 0, comm=comm),
        lambda v: mpi4jax.allgather(v, comm=comm),
        lambda v, left, right: mpi4jax.sendrecv(v, v, left, right, comm=comm),
        lambda v: mpi4jax.alltoall(v.reshape(size, -1), comm=comm),
    )
    return functions, None


def looped(fn, steps):
    """``fn`` applied ``steps`` times in a jitted fori_loop, its result the next operand.

    allgather's result is larger than its operand: its first block goes on.
    """

    def body(_, v):
        return fn(v)[: v.shape[0]]

    return jax.jit(lambda v: jax.lax.fori_loop(0, steps, body, v))


def jitted(functions):
    return {name: jax.jit(fn) for name, fn in functions.items()}


def by_hand_call(op, comm, x, device):
    """The transfer a user would write without jaxcomm: to NumPy, mpi4py, back."""
    rank, size = comm.Get_rank(), comm.Get_size()
    n = x.shape[0]
    out = np.empty(n * size if op == "allgather" else n, np.float32)

    def call():
        if op == "bcast":
            host = np.asarray(jax.device_get(x)) if rank == 0 else out
            comm.Bcast(host, root=0)
            result = host
        else:
            host = np.asarray(jax.device_get(x))
            if op == "allreduce":
                comm.Allreduce(host, out, op=MPI.SUM)
            elif op == "allgather":
                comm.Allgather(host, out)
            elif op == "alltoall":
                comm.Alltoall(host, out)
            elif op == "ragged":
                starts, sends, _, receives = ragged_layout(rank, size, n)
                comm.Alltoallv([host, sends, starts, MPI.FLOAT], [out, receives, starts, MPI.FLOAT])
            else:
                comm.Sendrecv(host, (rank + 1) % size, recvbuf=out, source=(rank - 1) % size)
            result = out
        jax.device_put(result, device).block_until_ready()

    return call


def _cuda_home():
    nvcc = shutil.which("nvcc")
    candidates = [pathlib.Path(nvcc).resolve().parent.parent] if nvcc else []
    candidates += [
        pathlib.Path(p)
        for p in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda")
        if p
    ]
    for home in candidates:
        if (home / "include" / "cuda_runtime.h").exists():
            return home
    raise RuntimeError("CUDA not found: put nvcc on PATH or set CUDA_HOME")


def mpi_cxx() -> tuple[list[str], list[str]]:
    """The MPI C++17 compiler command and the link flags it needs after the sources.

    Raises:
        RuntimeError: if neither ``mpicxx`` nor ``mpicc`` is on ``PATH``.
    """
    mpicxx = shutil.which("mpicxx")
    if mpicxx:
        return [mpicxx, "-std=c++17"], []
    if shutil.which("mpicc"):
        return [shutil.which("mpicc"), "-x", "c++", "-std=c++17"], ["-lstdc++"]
    raise RuntimeError("no mpicxx or mpicc on PATH: use the MPI mpi4py runs")


def compile_reference(build_dir):
    """Build gpu_reference.cc into ``build_dir`` (once per source and MPI), return its path."""
    cuda = _cuda_home()
    compiler, extra = mpi_cxx()
    flags = [
        f"-I{cuda}/include",
        f"-L{cuda}/lib64",
        "-lcudart_static",
        "-ldl",
        "-lrt",
        "-lpthread",
        *extra,
    ]
    return build_shared(HERE / "gpu_reference.cc", compiler, flags, build_dir)


def load_reference(comm, build_dir):
    """The C++ reference via ctypes; node-local rank 0 builds it, the others wait."""
    lib, error = load_on_every_rank(comm, lambda: compile_reference(build_dir))
    if lib is None:
        return None, error
    lib.jaxcomm_reference.restype = ctypes.c_double
    lib.jaxcomm_reference.argtypes = [
        ctypes.c_int,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
    ]
    lib.jaxcomm_reference_error.restype = ctypes.c_char_p
    return lib, None


def reference_seconds(lib, op, comm, x, out, iterations, direct=False):
    x.block_until_ready()
    out.block_until_ready()
    comm.Barrier()
    seconds = lib.jaxcomm_reference(
        KIND[op],
        comm.py2f(),
        x.unsafe_buffer_pointer(),
        out.unsafe_buffer_pointer(),
        x.nbytes,
        iterations,
        2,
        int(direct),
    )
    if seconds < 0:
        raise RuntimeError(lib.jaxcomm_reference_error().decode())
    return seconds


def data_paths():
    """jaxcomm's GPU data paths to measure: (label, set_cuda_aware value)."""
    paths = [("host staging", False)]
    if MPI.COMM_WORLD.allreduce(cuda_info()["mpi_cuda_support"] is True, op=MPI.LAND):
        paths.append(("cuda-aware", True))
    return paths


def measure(name, fn, comm, log):
    """``fn()``'s seconds, or None (with the error logged) if it raised on any rank."""
    try:
        seconds, error = fn(), None
    except Exception as err:  # noqa: BLE001  (one failing method must not end the run)
        seconds, error = None, f"{type(err).__name__}: {err}".splitlines()[0]
    failed = comm.allreduce(error is not None, op=MPI.LOR)
    if failed and comm.Get_rank() == 0:
        log(f"  {name}: {error or 'failed on another rank'}")
    return (None, error or "failed on another rank") if failed else (seconds, None)


LOOP_CPP = "C++ ref: copy, sync, MPI, copy"


def loop_latency(jc, comm, device, steps, label, lib, mpi4jax_ops, hlo=None):
    """8 B allreduce: seconds per iteration of each loop, and jaxcomm's handler clock."""
    x = jax.device_put(np.zeros(2, np.float32), device)  # sums stay zero
    jaxcomm_loop = looped(lambda v: jc.allreduce(v), steps)
    if hlo:
        pathlib.Path(hlo).write_text(jaxcomm_loop.lower(x).compile().as_text())
    buf, out = np.zeros(2, np.float32), np.empty(2, np.float32)

    def per_call(call, repeats=5):
        return median_seconds(call, repeats, comm) / steps

    def by_hand():
        for _ in range(steps):
            comm.Allreduce(buf, out)

    kernels = _runtime.load_cuda_kernels()
    clock = kernels is not None and device.platform == "gpu"
    times = {}
    if clock:
        jaxcomm_loop(x).block_until_ready()
        kernels.reset_handler_clock()
    times[f"jaxcomm fori_loop: {label}"] = per_call(lambda: jaxcomm_loop(x).block_until_ready())
    if clock:
        calls, handler_ns, wait_ns = kernels.handler_clock()
        times["jaxcomm handler, per call"] = handler_ns * 1e-9 / max(calls, 1)
        times["jaxcomm handler waiting for the GPU, per call"] = wait_ns * 1e-9 / max(calls, 1)
    if mpi4jax_ops is not None:
        m4j = looped(mpi4jax_ops["allreduce"], steps)
        times["mpi4jax fori_loop"] = per_call(lambda: m4j(x).block_until_ready())
    if lib is not None:
        target = jax.device_put(np.zeros(2, np.float32), device)
        times[LOOP_CPP] = reference_seconds(lib, "allreduce", comm, x, target, steps * 5)
    empty = jax.jit(lambda v: jax.lax.fori_loop(0, steps, lambda _, w: w + 1, v))
    times["empty fori_loop (w + 1 on the device)"] = per_call(lambda: empty(x).block_until_ready())
    # What one jitted call costs without MPI: JAX's dispatch and one kernel.
    jitted_call = jax.jit(lambda v: v + 1)
    jaxcomm_call = jax.jit(lambda v: jc.allreduce(v))
    for name, fn in (
        ("plain jitted call (w + 1)", jitted_call),
        ("jaxcomm jitted call", jaxcomm_call),
    ):
        times[name] = median_seconds(lambda fn=fn: fn(x).block_until_ready(), steps, comm, warmup=3)
    times["mpi4py Allreduce on NumPy"] = per_call(by_hand)
    return times


def measure_size(op, nbytes, args, comm, device, paths, use_path, lib, m4j, log):
    """Results of every method for one op and size."""
    iterations = iterations_for(nbytes, args.quick)
    steps = max(2, min(LOOP_STEPS, iterations))
    n = nbytes // 4
    x = jax.device_put(np.ones(n, np.float32), device)
    results = []

    def record(method, fn):
        seconds, error = measure(f"{op} {format_size(nbytes)} {method}", fn, comm, log)
        results.append(
            {"op": op, "bytes": nbytes, "method": method, "seconds": seconds, "error": error}
        )

    def timed(call):
        return lambda: call_seconds(lambda: call(x).block_until_ready(), iterations, comm)

    def loop_timed(fn):
        loop = looped(fn, steps)
        return lambda: median_seconds(lambda: loop(x).block_until_ready(), 3, comm) / steps

    for label, cuda_aware in paths:
        calls = use_path(label, cuda_aware)
        record(f"jaxcomm: {label}", timed(calls["jit"][op]))
        record(f"jaxcomm loop: {label}", loop_timed(calls["functions"][op]))
        if label != "host staging":
            continue
        default = pipeline_bytes()
        for piece in args.pieces:
            if nbytes < TARGET_FROM or nbytes < 2 * piece:
                continue
            set_pipeline_bytes(piece)
            try:
                record(f"jaxcomm: {label}, pieces {format_size(piece)}", timed(calls["jit"][op]))
            finally:
                set_pipeline_bytes(default)
    if m4j is not None and op in m4j["jit"]:
        record("mpi4jax", timed(m4j["jit"][op]))
        record("mpi4jax loop", loop_timed(m4j["functions"][op]))
    record("by hand", lambda: call_seconds(by_hand_call(op, comm, x, device), iterations, comm))
    if lib is not None:
        out_rows = n * comm.Get_size() if op == "allgather" else n
        target = jax.device_put(np.zeros(out_rows, np.float32), device)
        record("C++ ref", lambda: reference_seconds(lib, op, comm, x, target, iterations))
        if any(cuda_aware for _, cuda_aware in paths):
            record(
                "C++ direct",
                lambda: reference_seconds(lib, op, comm, x, target, iterations, direct=True),
            )
    return results


def main(argv=None):
    args = parse_args(argv)
    if not args.cpu:
        try:
            bind_local_gpu()  # before JAX starts its backends
        except RuntimeError:
            pass  # no GPU on this node: said below, when JAX finds none
    comm = MPI.COMM_WORLD.Clone()
    rank = comm.Get_rank()
    log = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    out = pathlib.Path(args.out)

    try:
        gpus = len(jax.devices("gpu"))
    except RuntimeError:
        gpus = 0
    if not args.cpu and not comm.allreduce(gpus, op=MPI.MIN):
        message = (
            f"gpu.py: JAX sees no GPU (on at least one rank; platforms here: "
            f"{sorted({d.platform for d in jax.devices()})}): nothing measured. Run it "
            "where jax has CUDA and a GPU, or pass --cpu to check the script on CPU."
        )
        log(message)
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            (out / "table.md").write_text(message + "\n")
        return 0

    device = jax.devices("cpu" if args.cpu else "gpu")[0]
    jc = JaxComm(comm)
    paths = [("cpu", None)] if args.cpu else data_paths()
    lib, ref_error = (None, "not with --cpu") if args.cpu else load_reference(comm, args.build_dir)
    if ref_error:
        log(f"C++ reference unavailable: {ref_error}")
    m4j_functions, m4j_error = mpi4jax_functions(comm)
    m4j = None
    if m4j_functions is not None:
        m4j = {"functions": m4j_functions, "jit": jitted(m4j_functions)}
    else:
        log(f"{m4j_error}: no mpi4jax columns")
    info = None if args.cpu else cuda_info()
    meta = {
        "ranks": comm.Get_size(),
        "device": str(device),
        "jax": jax.__version__,
        "jaxcomm": __version__,
        "mpi4jax": _mpi4jax_version(),
        "mpi4jax_use_cuda_mpi": os.environ.get("MPI4JAX_USE_CUDA_MPI"),
        "mpi": MPI.Get_library_version().splitlines()[0],
        "cuda_info": info,
        "pipeline_bytes": pipeline_bytes(),
        "quick": args.quick,
        "label": args.label,
    }
    log(
        f"{comm.Get_size()} ranks on {device}; jax {jax.__version__}, {meta['mpi'].strip()}, "
        f"mpi4jax {meta['mpi4jax']}, pipeline pieces {format_size(pipeline_bytes())}"
        + (f"; {args.label}" if args.label else "")
    )
    log(f"cuda_info: {info}")

    results = []
    current = {"path": None}

    def use_path(label, cuda_aware):
        """Switch jaxcomm's data path; compiled code is dropped on a switch."""
        if current["path"] != label:
            if cuda_aware is not None:
                set_cuda_aware(cuda_aware)
                jax.clear_caches()
            functions = jaxcomm_functions(jc)
            current.update(path=label, functions=functions, jit=jitted(functions))
        return current

    if not args.latency_only:
        for op in args.ops:
            for nbytes in sizes_for(args):
                if not fits(op, nbytes, comm.Get_size()):
                    continue
                done = measure_size(op, nbytes, args, comm, device, paths, use_path, lib, m4j, log)
                results += done
                log(
                    f"{op:>9} {format_size(nbytes):>8}: "
                    + ", ".join(f"{r['method']} {_cell(_us(r['seconds']), '.1f')} us" for r in done)
                )
            # What is measured so far, in case a time limit ends the run.
            if rank == 0:
                write_results(out, results, table_rows(results), {}, [], meta, plot=False)

    loop = {}
    steps = 200 if args.quick else 1000
    for label, cuda_aware in paths:
        use_path(label, cuda_aware)
        timing = measure(
            f"fori_loop {label}",
            lambda label=label: loop_latency(
                jc, comm, device, steps, label, lib, m4j_functions, args.hlo
            ),
            comm,
            log,
        )[0]
        loop.update(timing or {f"jaxcomm fori_loop: {label}": None})
    if not args.cpu:
        set_cuda_aware(None)

    if rank == 0:
        rows = table_rows(results)
        checks = check_targets(rows, loop)
        plot = write_results(out, results, rows, loop, checks, meta)
        print()
        print(markdown_table(rows, loop))
        print("\nTargets (reported, not asserted):")
        for verdict, text in checks:
            print(f"  {verdict.upper():4} {text}")
        plotted = f" (plot {plot.name})" if plot else " (no matplotlib: no plot)"
        print(f"\nresults in {out}{plotted}")
    jc.free()
    comm.Free()
    return 0


def _mpi4jax_version():
    try:
        from importlib.metadata import version

        return version("mpi4jax")
    except Exception:  # noqa: BLE001  (not installed, or no metadata)
        return None


if __name__ == "__main__":
    sys.exit(main())
