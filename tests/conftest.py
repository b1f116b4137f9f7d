"""Test-session setup shared by every test module.

On a host without CUDA, Triton kernels can only run under its interpreter, and Triton decides
between interpreted and compiled kernels when a kernel is defined, so the switch must be set
before any kvfuse Triton module is imported.
"""

import os
import tempfile

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Inductor's on-disk caches are keyed on the graph, not on the custom ops' code behind it: a run
# of another kvfuse checkout (or version) on the same machine could serve graphs compiled against
# its op schemas. Each test session gets its own cache directory (tests that study the cache set
# their own).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="kvfuse-tests-inductor-"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _fresh_settings():
    """kvfuse reads its environment once (kvfuse.envs): a test that sets a variable calls
    kvfuse.envs.reload() (or registry.clear_cache()); every test starts and ends from the real
    environment."""
    from kvfuse import envs

    envs.reload()
    yield
    envs.reload()


@pytest.fixture
def reference_backend(monkeypatch):
    """Pin every op to the CPU reference semantics, whatever other backends are installed."""
    from kvfuse.ops import registry

    monkeypatch.setenv("KVFUSE_BACKEND", "reference")
    registry.clear_cache()
    yield
    registry.clear_cache()
