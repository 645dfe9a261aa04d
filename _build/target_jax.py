"""Which jaxlib's XLA FFI headers the kernels compile against (standard library only).

A jaxlib refuses handlers built against a newer FFI API than its own ("XLA
FFI handler registration ... failed"), and accepts those built against an
older one. A source build therefore compiles against the headers of the
oldest supported jaxlib, 0.6.2, as the binary wheel does: the kernels then
load under every jax from 0.6 on, whatever jax the same command, a
requirements file or a later upgrade installs. jaxlib 0.6.2 publishes wheels
for Python 3.10 to 3.13; on another Python the build takes the target
environment's jaxlib instead, and says so.

pip runs the build backend with the target environment's interpreter and hides
that environment's site-packages through ``PYTHONPATH`` (a ``sitecustomize``);
the same interpreter started without that ``PYTHONPATH`` sees them again.
Front-ends that build in a separate environment (``python -m build``, uv)
leave ``VIRTUAL_ENV`` naming the target, when one is activated.
"""

import os
import subprocess
import sys

# jaxcomm's oldest supported jax, the jaxlib whose headers a build compiles
# against, and the Pythons that jaxlib has wheels for.
OLDEST = "0.6"
FFI_JAXLIB = "0.6.2"
FFI_JAXLIB_PYTHONS = ((3, 10), (3, 11), (3, 12), (3, 13))

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


def jaxlib_requirement(python=None):
    """The jaxlib whose FFI headers the build compiles against, as a requirement.

    jaxlib 0.6.2 where it has a wheel for the build's Python (``python``,
    ``(major, minor)``, defaults to the running one). Elsewhere the target
    environment's own jaxlib, else the newest, which pip then installs there
    too. ``JAXCOMM_JAXLIB`` overrides the choice (a version, such as
    ``0.8.3``).
    """
    version = os.environ.get("JAXCOMM_JAXLIB")
    if version:
        return f"jaxlib=={version}"
    python = tuple(python or sys.version_info[:2])
    if python in FFI_JAXLIB_PYTHONS:
        return f"jaxlib=={FFI_JAXLIB}"
    for interpreter in _interpreters():
        version = installed_jaxlib(interpreter)
        if version:
            break
    print(
        f"jaxcomm: jaxlib {FFI_JAXLIB} has no wheel for Python {python[0]}.{python[1]}; "
        f"compiling against the XLA FFI headers of jaxlib {version or 'newest'}, which "
        "jaxlibs older than it refuse",
        file=sys.stderr,
    )
    return f"jaxlib=={version}" if version else f"jaxlib>={OLDEST}"
