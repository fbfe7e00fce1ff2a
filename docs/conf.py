"""Sphinx configuration: the Markdown pages (MyST) and the API reference (autodoc) of fastinfer.

Build with ``make docs`` (``sphinx-build -W --keep-going -b html docs build/docs``); autodoc imports
the installed package, so the extension must be built first.
"""

project = "fastinfer"
author = "fastinfer contributors"
copyright = "fastinfer contributors"

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# Docstrings use Google style ("Args:", "Returns:") and ``literal`` markup.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "undoc-members": False}

# Heading anchors, so pages can link to each other's sections.
myst_heading_anchors = 3

html_theme = "alabaster"
html_title = "fastinfer"
