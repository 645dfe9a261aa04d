"""Check which data path GPU arrays took: did MPI get the device pointers?

Run under a CUDA-aware Open MPI, once per path, with its CUDA logging on:

    OMPI_MCA_mpi_common_cuda_verbose=10 OMPI_MCA_btl_smcuda_cuda_ipc_verbose=10 \\
      JAXCOMM_CUDA_AWARE=1 mpiexec -n 2 python tests/gpu/direct_path.py direct
    ... JAXCOMM_CUDA_AWARE=0 ... python tests/gpu/direct_path.py staging

Each rank moves GPU arrays of 8 B to 64 MiB through jitted sendrecv (a ring),
allreduce, alltoall and a ragged exchange, checks every result against
NumPy, and prints one line per rank: the path jaxcomm says it takes and the
pinned host memory it holds for staging. On the direct path jaxcomm stages
no data: that memory stays within one 1 MiB chunk (the least the staging
arena takes), which holds only what MPI reads or writes on the host whatever
the path, sendrecv's status envelope and the ragged exchange's counts, while
every data buffer went to MPI as a device pointer; on the staging path it
holds at least the largest message. Open MPI's own log says what it did with them: between two
processes on one GPU, the smcuda transport opens the peer's buffer with
CUDA IPC ("cuIpcOpenMemHandle passed"), which it can only do for device
memory; on the staging path it never does (run.sh counts those lines in
both runs). Exits non-zero when a result is wrong or the path is not the
one asked for.

Under ``JAXCOMM_EMULATE_CUDA=1`` (tests/cuda_emulation/README.md) CPU arrays
stand in for GPU arrays, which checks this script's own logic on a machine
without a GPU (there is no CUDA IPC to see there).
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

import jaxcomm
from jaxcomm import JaxComm

SIZES = [8, 4096, 1 << 20, 16 << 20, 64 << 20]
REPEATS = 3  # Open MPI sets CUDA IPC up on a peer's first large message
MIN_CHUNK = 1 << 20  # the least pinned memory jaxcomm's staging arena takes


def main(expected):
    # Under JAXCOMM_EMULATE_CUDA=1 (tests/cuda_emulation) the CPU stands in
    # for the GPU: the script's own logic runs anywhere, without CUDA IPC.
    emulated = os.environ.get("JAXCOMM_EMULATE_CUDA", "") not in ("", "0")
    if not emulated:
        jaxcomm.bind_local_gpu()
    jc = JaxComm(MPI.COMM_WORLD)
    rank, size = jc.rank, jc.size
    gpu = jax.devices("cpu" if emulated else "gpu")[0]
    info = jaxcomm.cuda_info()
    want_direct = expected == "direct"
    problems = []
    if info["cuda_aware"] is not want_direct:
        problems.append(f"jaxcomm takes the {info['path']} path, not {expected}")

    right, left = (rank + 1) % size, (rank - 1) % size
    ring = jax.jit(lambda v: jc.sendrecv(v, v, source=left, dest=right))
    total = jax.jit(lambda v: jc.allreduce(v, op=MPI.SUM))
    shares = jax.jit(lambda v: jc.alltoall(v, tiled=True))

    def ragged(v):
        n = v.shape[0]
        chunk = n // size
        send = np.full(size, chunk, np.int32)
        return jc.ragged_all_to_all(
            v,
            jnp.zeros_like(v),
            np.arange(size, dtype=np.int32) * chunk,
            send,
            np.full(size, rank * chunk, np.int32),
            send,
        )

    ragged = jax.jit(ragged)
    ops = {"sendrecv": ring, "allreduce": total, "alltoall": shares, "ragged": ragged}
    held = {}
    # The ragged exchange last, to tell its counts (host memory on either
    # path) from the data ops in the figures printed.
    for group in (("sendrecv", "allreduce", "alltoall"), ("ragged",)):
        for nbytes in SIZES:
            n = max(size, nbytes // 4 // size * size)
            # Small integers: float32 sums stay exact.
            base = (np.arange(n) % 4096).astype(np.float32)
            x = jax.device_put(base + 4096 * rank, gpu)
            chunk = n // size
            shares_here = np.concatenate(
                [base[rank * chunk : (rank + 1) * chunk] + 4096 * j for j in range(size)]
            )
            want = {
                "sendrecv": base + 4096 * left,
                "allreduce": size * base + 4096 * size * (size - 1) / 2,
                "alltoall": shares_here,
                "ragged": shares_here,
            }
            for name in group:
                for _ in range(REPEATS):
                    value = ops[name](x)
                if value.devices() != {gpu}:
                    problems.append(f"{name} {nbytes} B: result on {value.devices()}")
                if not np.array_equal(np.asarray(value), want[name]):
                    problems.append(f"{name} {nbytes} B: wrong result")
        held[group[-1]] = jaxcomm.cuda_info()["staging_bytes"]
    data, counts = held["alltoall"], held["ragged"]
    if want_direct and max(data, counts) > MIN_CHUNK:
        problems.append(
            f"{data} B of pinned staging memory held after the data ops, {counts} B after "
            "the ragged exchange, on the direct path"
        )
    if not want_direct and data < SIZES[-1]:
        problems.append(f"only {data} B of staging memory held on the staging path")
    verdict = "ok" if not problems else "FAILED: " + "; ".join(problems)
    print(
        f"rank {rank}: path {info['path']}, mpi_cuda_support {info['mpi_cuda_support']}, "
        f"staging memory after sendrecv/allreduce/alltoall {data} B, after the ragged "
        f"exchange {counts} B: {verdict}",
        flush=True,
    )
    failed = jc.comm.allreduce(bool(problems), op=MPI.LOR)
    jc.free()
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("direct", "staging"):
        sys.exit("usage: direct_path.py direct|staging")
    sys.exit(main(sys.argv[1]))
