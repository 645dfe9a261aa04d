"""glibc's malloc keeps freed memory for the next call's buffers (jaxcomm/_malloc.py).

Each case imports jaxcomm in a fresh Python process, since the setting is made
once, at import. The effect is read from glibc itself: after 16 MiB of blocks
are freed, ``mallinfo2().keepcost`` (the free memory left at the top of the
heap, which the next allocations reuse) holds them where jaxcomm set the pad,
and glibc's own trimming has returned them to Linux where it did not.
"""

import json
import subprocess
import sys
from functools import partial

import pytest
from at_once import at_once
from conftest import environment_without_launcher, spawns_own_mpi

from jaxcomm import _malloc

MIB = 1 << 20

_PROBE = r"""
import ctypes, json
import jaxcomm
from jaxcomm import _malloc, _runtime

kept = None
libc = _malloc._glibc()
if libc is not None and hasattr(libc, "mallinfo2"):
    class Info(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]
    libc.mallinfo2.restype = Info
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(4 << 20) for _ in range(4)]
    for block in reversed(blocks):
        libc.free(block)
    kept = libc.mallinfo2().keepcost
print(json.dumps({"pad": _runtime.malloc_pad, "kept": kept}))
"""


def _probe(tmp_path, **env):
    # Run from elsewhere than the source tree, which has no kernels.
    return subprocess.run(
        [sys.executable, "-c", _PROBE],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=environment_without_launcher(**env),
    )


def _found(done):
    """The pad and the memory kept that a probe found."""
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


# Only each case's own malloc settings count.
CLEAN = {"GLIBC_TUNABLES": ""}

LEFT_ALONE = {
    "switched off": {"JAXCOMM_MALLOC_PAD": "0"},
    "MALLOC_TOP_PAD_": {"MALLOC_TOP_PAD_": str(128 << 10)},
    "GLIBC_TUNABLES": {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"},
}
OWN_PAD = str(8 * MIB)
BAD_PADS = ["-1", "lots"]


def _import(tmp_path, **env):
    return subprocess.run(
        [sys.executable, "-c", "import jaxcomm"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=environment_without_launcher(**env),
    )


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    """Every case's process (a probe, or an import refused), started together."""
    cases = {"default": {}, **LEFT_ALONE, "own pad": {"JAXCOMM_MALLOC_PAD": OWN_PAD}}
    jobs = {
        name: partial(_probe, tmp_path_factory.mktemp("malloc"), **{**CLEAN, **env})
        for name, env in cases.items()
    }
    for text in BAD_PADS:
        jobs[f"bad pad {text}"] = partial(
            _import, tmp_path_factory.mktemp("malloc"), JAXCOMM_MALLOC_PAD=text
        )
    return dict(zip(jobs, at_once(*jobs.values())))


@spawns_own_mpi
def test_freed_memory_is_kept_by_default(probes):
    if _malloc._glibc() is None:
        pytest.skip("not glibc: malloc is left as it is")
    got = _found(probes["default"])
    assert got["pad"] == _malloc.DEFAULT_PAD
    if got["kept"] is not None:
        assert got["kept"] >= 16 * MIB


@spawns_own_mpi
@pytest.mark.parametrize("case", list(LEFT_ALONE))
def test_malloc_is_left_alone_when_asked_or_set_by_the_user(probes, case):
    got = _found(probes[case])
    assert got["pad"] == 0
    if got["kept"] is not None:
        # glibc trimmed the freed blocks: at most its own pad (128 KiB) is left.
        assert got["kept"] < 16 * MIB


@spawns_own_mpi
def test_a_pad_of_its_own(probes):
    if _malloc._glibc() is None:
        pytest.skip("not glibc: malloc is left as it is")
    assert _found(probes["own pad"])["pad"] == 8 * MIB


@spawns_own_mpi
@pytest.mark.parametrize("text", BAD_PADS)
def test_bad_pads_are_refused_at_import(probes, text):
    done = probes[f"bad pad {text}"]
    assert done.returncode != 0
    assert "JAXCOMM_MALLOC_PAD" in done.stderr


def test_the_users_own_settings_are_recognised():
    assert _malloc.user_settings({}) == []
    assert _malloc.user_settings({"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX"}) == []
    assert _malloc.user_settings({"MALLOC_MMAP_THRESHOLD_": "1"}) == ["MALLOC_MMAP_THRESHOLD_"]
    tunables = {"GLIBC_TUNABLES": "glibc.malloc.top_pad=1:glibc.malloc.mmap_threshold=2"}
    assert _malloc.user_settings(tunables) == [
        "glibc.malloc.top_pad",
        "glibc.malloc.mmap_threshold",
    ]


def test_the_settings_in_effect_name_jaxcomms_and_the_users():
    assert _malloc.in_effect(64 * MIB, {}) == {
        "jaxcomm_pad": 64 * MIB,
        "jaxcomm_mmap_threshold": _malloc.MMAP_THRESHOLD,
        "user": {},
    }
    env = {
        "MALLOC_MMAP_THRESHOLD_": "268435456",
        "MALLOC_TOP_PAD_": "67108864",
        "GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX",
        "HOME": "/root",
    }
    assert _malloc.in_effect(0, env) == {
        "jaxcomm_pad": 0,
        "jaxcomm_mmap_threshold": 0,
        "user": {"MALLOC_MMAP_THRESHOLD_": "268435456", "MALLOC_TOP_PAD_": "67108864"},
    }
    tunables = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1:glibc.malloc.trim_threshold=9"}
    assert _malloc.in_effect(0, tunables)["user"] == tunables
    # hugetlb alone leaves jaxcomm's settings in place, and is recorded beside them.
    hugetlb = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    assert _malloc.user_settings(hugetlb) == []
    assert _malloc.in_effect(64 * MIB, hugetlb)["user"] == hugetlb
