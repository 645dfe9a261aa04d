"""Which jaxlib the wheel being built will run with (standard library only).

The kernels are compiled against the XLA FFI headers that jaxlib ships, and
a jaxlib refuses handlers built against a newer FFI API than its own ("XLA FFI
handler registration ... failed"). An isolated build environment would
otherwise get the newest jaxlib on the index, so a user whose environment pins
an older jax would get kernels that do not load. The build therefore asks for
the jaxlib of the environment it installs into.

pip runs the build backend with the target environment's interpreter and hides
that environment's site-packages through ``PYTHONPATH`` (a ``sitecustomize``);
the same interpreter started without that ``PYTHONPATH`` sees them again.
Front-ends that build in a separate environment (``python -m build``, uv)
leave ``VIRTUAL_ENV`` naming the target, when one is activated.
"""

import os
import subprocess
import sys

# jaxcomm's oldest supported jax, and the first jaxlib whose headers it compiles against.
OLDEST = "0.6"

_PROBE = "import importlib.metadata as m; print(m.version('jaxlib'))"


def _interpreters():
    """Python interpreters that may be the target environment's, most likely first."""
    seen = []
    candidates = [sys.executable]
    for variable in ("VIRTUAL_ENV", "CONDA_PREFIX"):
        prefix = os.environ.get(variable)
        if prefix:
            candidates += [os.path.join(prefix, "bin", "python"), os.path.join(prefix, "python.exe")]
    for path in candidates:
        if path and os.path.exists(path) and path not in seen:
            seen.append(path)
    return seen


def installed_jaxlib(python):
    """The jaxlib version ``python`` sees outside any build isolation, or None."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    try:
        result = subprocess.run(
            [python, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.SubprocessError):
        return None
    version = result.stdout.strip()
    return version if result.returncode == 0 and version else None


def jaxlib_requirement():
    """The jaxlib the build environment needs: the target's own, else the newest.

    ``JAXCOMM_JAXLIB`` overrides the choice (a version, such as ``0.6.2``).
    With no jaxlib in the target yet, pip installs the newest one that fits
    there too, which the unpinned requirement also gets.
    """
    version = os.environ.get("JAXCOMM_JAXLIB")
    if not version:
        for python in _interpreters():
            version = installed_jaxlib(python)
            if version:
                break
    return f"jaxlib=={version}" if version else f"jaxlib>={OLDEST}"
