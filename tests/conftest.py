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
_TRITON_INTERPRET_AT_START = os.environ.get("TRITON_INTERPRET")

# Inductor's on-disk caches are keyed on the graph, not on the custom ops' code behind it: a run
# of another kvfuse checkout (or version) on the same machine could serve graphs compiled against
# its op schemas. Each test session gets its own cache directory (tests that study the cache set
# their own).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="kvfuse-tests-inductor-"))


def pytest_runtest_logreport(report):
    """With KVFUSE_FAILURE_LOG set, each failure's traceback is appended to that file as it
    happens: a GPU phase cut by its time limit never reaches pytest's end-of-run summary."""
    path = os.environ.get("KVFUSE_FAILURE_LOG")
    # Under xdist both the worker and the controller see each report: the controller writes.
    if path and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:
        with open(path, "a", encoding="utf-8") as log:
            log.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        # A test module that sets TRITON_INTERPRET while being collected turns every kernel
        # defined after it into an interpreted one, for the whole session: on a GPU that is slow,
        # and the interpreter's numerics are not the compiled kernels'. Only this file decides.
        if os.environ.get("TRITON_INTERPRET") != _TRITON_INTERPRET_AT_START:
            raise pytest.UsageError(
                f"TRITON_INTERPRET changed from {_TRITON_INTERPRET_AT_START!r} to "
                f"{os.environ.get('TRITON_INTERPRET')!r} while test modules were imported on a CUDA host; "
                "set it only under `if not torch.cuda.is_available()`")
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# A test without the gpu mark that hands CPU tensors to a Triton kernel needs the interpreter,
# which only a host without CUDA gets (above); on a CUDA host Triton's launcher refuses them, and
# kvfuse's registry refuses a Triton backend forced for CPU tensors.
_CPU_TRITON_REFUSALS = ("cannot be accessed from Triton (cpu tensor?)",
                        "Triton kernels run on CUDA (or on CPU with TRITON_INTERPRET=1), not on cpu")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """On a CUDA host without the interpreter, a CPU test that reaches a Triton kernel with CPU
    tensors is skipped, saying so (its kernels run compiled in the -m gpu tests); tests with the
    gpu mark, and every other error, are reported as they are."""
    try:
        return (yield)
    except (ValueError, RuntimeError) as error:
        if (any(refusal in str(error) for refusal in _CPU_TRITON_REFUSALS) and torch.cuda.is_available()
                and os.environ.get("TRITON_INTERPRET") != "1" and item.get_closest_marker("gpu") is None):
            pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1, which conftest sets only on hosts "
                        "without CUDA")
        raise


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
