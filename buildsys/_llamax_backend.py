"""The PEP 517 build backend: setuptools', plus the build requirements that
depend on LLAMAX_BACKEND (pyproject.toml's ``backend-path`` points here).

A CUDA build (``LLAMAX_BACKEND=cuda``) compiles against cuBLAS.  When the
CUDA toolkit has none (a toolkit installed from NVIDIA's pip wheels, as on
these machines and in the CUDA wheel build), cuBLAS comes from the
``nvidia-cublas`` wheel matching nvcc's major version, which is then also the
built wheel's run-time dependency (setup.py).  Every other build needs
nothing beyond ``[build-system] requires``.

An editable install (``pip install -e .``, the README's commands) also
installs the dev helpers, tools/llamax_dev, so that the benchmarks and tools
import them; setup.py adds them when this backend says the build is an
editable one, and a wheel never has them.
"""
from __future__ import annotations

import os
from contextlib import contextmanager

from setuptools import build_meta as _orig
from setuptools.build_meta import *  # noqa: F401,F403  (the hooks this module doesn't change)

import build_llama_cpp as _build  # buildsys/, on sys.path as the backend-path


def _extra() -> list[str]:
    req = _build.cublas_wheel_requirement()
    return [req] if req else []


def get_requires_for_build_wheel(config_settings=None):
    return _orig.get_requires_for_build_wheel(config_settings) + _extra()


def get_requires_for_build_editable(config_settings=None):
    return _orig.get_requires_for_build_editable(config_settings) + _extra()


@contextmanager
def _editable():
    os.environ["_LLAMAX_EDITABLE_BUILD"] = "1"   # read by setup.py, which runs in this process
    try:
        yield
    finally:
        os.environ.pop("_LLAMAX_EDITABLE_BUILD", None)


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
    with _editable():
        return _orig.prepare_metadata_for_build_editable(metadata_directory, config_settings)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    with _editable():
        return _orig.build_editable(wheel_directory, config_settings, metadata_directory)
