"""Only here because setuptools reads `cffi_modules` from setup() and not from pyproject.toml.

Everything else about the package lives in pyproject.toml.
"""

from setuptools import setup

setup(cffi_modules=["native/build_ffi.py:ffibuilder"])
