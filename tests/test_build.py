"""The build compiles the kernels against the XLA FFI headers of the jaxlib they run with."""

import importlib.metadata
import os
import pathlib
import subprocess
import sys

import jaxlib
import pytest

from jaxcomm import _build_info, _runtime

_ROOT = pathlib.Path(__file__).resolve().parent.parent

# What pip's build isolation puts on PYTHONPATH: a sitecustomize that hides
# the target environment's site-packages from the build backend.
ISOLATION = """
import site, sys
hidden = set(site.getsitepackages() + [site.getusersitepackages()])
sys.path[:] = [p for p in sys.path if p not in hidden]
"""

REQUIREMENT = """
import sys
sys.path.insert(0, sys.argv[1])
try:
    import jaxlib
except ImportError:
    print("isolated")
import target_jax
print(target_jax.jaxlib_requirement())
"""


def test_the_build_asks_for_the_jaxlib_of_the_environment_it_installs_into(tmp_path):
    # An isolated build of a wheel for an environment that pins an older jax
    # would otherwise get the newest jaxlib's headers, whose handlers the
    # pinned jaxlib refuses ("XLA FFI handler registration ... failed").
    (tmp_path / "sitecustomize.py").write_text(ISOLATION)
    env = {k: v for k, v in os.environ.items() if k not in ("JAXCOMM_JAXLIB", "VIRTUAL_ENV")}
    env["PYTHONPATH"] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", REQUIREMENT, str(_ROOT / "_build")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    isolated, requirement = done.stdout.split()
    assert isolated == "isolated"  # the backend itself cannot see jaxlib
    assert requirement == f"jaxlib=={importlib.metadata.version('jaxlib')}"


def test_the_installed_kernels_were_built_against_the_running_jaxlib():
    assert _build_info.JAXLIB_VERSION == jaxlib.__version__
    assert _build_info.FFI_API == _runtime._running_ffi_api()


@pytest.mark.parametrize(
    "built, running, refused",
    [
        ((0, 4), (0, 4), False),
        ((0, 1), (0, 4), False),
        ((0, 5), (0, 4), True),
        ((1, 0), (0, 4), True),
    ],
)
def test_a_jaxlib_older_than_the_headers_is_refused_at_import_with_the_fix(built, running, refused):
    reason = _runtime.ffi_api_mismatch(built, "0.12.0", running, "0.11.2")
    assert (reason is not None) == refused
    if refused:
        assert "headers of jaxlib 0.12.0" in reason and "runs jaxlib 0.11.2" in reason
        assert "pip install --force-reinstall --no-deps --no-cache-dir ." in reason
