"""Resident memory of this process, for the benchmarks that watch it grow."""


def rss_mib() -> float:
    """This process's resident memory now (VmRSS), in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")
