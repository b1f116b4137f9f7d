"""Test-session setup shared by every test module.

On a host without CUDA, Triton kernels can only run under its interpreter, and Triton decides
between interpreted and compiled kernels when a kernel is defined, so the switch must be set
before any kvfuse Triton module is imported.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def reference_backend(monkeypatch):
    """Pin every op to the CPU reference semantics, whatever other backends are installed."""
    from kvfuse.ops import backends

    monkeypatch.setenv("KVFUSE_BACKEND", "reference")
    backends.clear_cache()
    yield
    backends.clear_cache()
