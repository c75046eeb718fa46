"""Sphinx configuration: the API reference from the docstrings (autodoc, with napoleon for
their Google-style "Args:" sections) and the tutorials. ``tests/test_docs.py`` builds it
with warnings as errors and runs every code block of the tutorials."""
import os
import sys

sys.path.insert(0, os.path.abspath(".."))

import npattn  # noqa: E402

project = "npattn"
release = version = npattn.__version__
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
exclude_patterns = ["_build"]
html_theme = "alabaster"
