"""Sphinx configuration: furo theme, MyST Markdown, API reference from docstrings."""

from __future__ import annotations

import importlib.metadata
import os
import sys

import django

sys.path.insert(0, os.path.abspath(".."))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
django.setup()

project = "celery-fenced"
author = "celery-fenced developers"
release = importlib.metadata.version("celery-fenced")  # written once, in pyproject.toml
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
html_theme = "furo"
exclude_patterns = ["_build"]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
nitpicky = False
