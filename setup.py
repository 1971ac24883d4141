"""The optional C extension (ddpdoctor/rank/_fastcall.c); everything else is in pyproject.toml.

``optional=True``: where it cannot be built (no compiler, no Python headers) the install goes
on without it and the Python fast path is used (rank/patches/fastpath.py)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("ddpdoctor.rank._fastcall", ["ddpdoctor/rank/_fastcall.c"], optional=True)])
