"""Sphinx configuration for the jaxcomm documentation.

Build with the installed package: ``sphinx-build -W --keep-going -b html docs OUT``
from an environment where ``pip install ".[docs]"`` ran. The API reference is
generated from the docstrings of the installed jaxcomm.
"""

import os
import pathlib
import sys

# The source tree's jaxcomm has no compiled kernels and cannot be imported:
# `python -m sphinx` run from the checkout would otherwise find it first.
_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if pathlib.Path(p or os.getcwd()).resolve() != _ROOT]

import jaxcomm  # noqa: E402

if pathlib.Path(jaxcomm.__file__).resolve().parent == _ROOT / "jaxcomm":
    raise RuntimeError(
        f"conf.py imported jaxcomm from the source tree ({jaxcomm.__file__}); "
        "install it (pip install '.[docs]') and build from that environment"
    )

project = "jaxcomm"
author = "the jaxcomm developers"
copyright = "the jaxcomm developers"
release = jaxcomm.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx_copybutton",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# GitHub-style anchors, so that links such as [below](#soak-python--m-jaxcommbenchsoak)
# work both on GitHub and here.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
# MPI.SUM and MPI.ANY_SOURCE as written, not their repr or value.
autodoc_preserve_defaults = True
autodoc_class_signature = "separated"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# Prompts and shell output are not copied with the code.
copybutton_prompt_text = r">>> |\.\.\. |\$ "
copybutton_prompt_is_regexp = True

html_theme = "furo"
html_title = f"jaxcomm {release}"
