"""Debug dumps of what kvfuse compiles: depyf's sources plus kvfuse's own graphs and report.

``with kvfuse.debug.dump("dumps/"):`` wraps :func:`depyf.prepare_debug` (decompiled bytecode,
captured/AOT graphs, Inductor kernels) and adds, under ``dumps/kvfuse/``:

- ``NNN_<pass>.before.py`` / ``NNN_<pass>.after.py``: the post-grad graph before and after each
  kvfuse pass, as readable Python (``NNN`` counts pass runs in this process);
- ``report.json``: the backend's
  whole current report (see :attr:`kvfuse.backend.KVFuseBackend.report`).

Setting ``KVFUSE_DUMP_DIR`` (:mod:`kvfuse.envs`) makes the backend write the kvfuse files there
for every compile, without a ``with`` block (depyf's part needs the ``with`` block: it must wrap
the code that triggers compilation); ``dump()`` with no argument uses that directory too.

While a dump is active the backend bypasses Inductor's caches, so the pass graphs are written
on a warm cache as on a cold one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from typing import Iterator, Optional

logger = logging.getLogger(__name__)

from . import envs

ENV_VAR = "KVFUSE_DUMP_DIR"
SUBDIR = "kvfuse"
_active = threading.local()


def active_dump_dir() -> Optional[str]:
    """The directory kvfuse files go to now: the innermost ``dump()``, else ``$KVFUSE_DUMP_DIR``."""
    stack = getattr(_active, "stack", None)
    if stack:
        return stack[-1]
    return envs.settings().dump_dir


@contextlib.contextmanager
def dump(dir: Optional[str] = None) -> Iterator[str]:
    """Dump everything compiled inside the block to ``dir`` (default ``$KVFUSE_DUMP_DIR``)."""
    dir = dir if dir is not None else envs.settings().dump_dir
    if not dir or not isinstance(dir, (str, os.PathLike)):
        raise ValueError(f"dump(dir={dir!r}): pass a directory path or set {ENV_VAR}")
    dir = os.path.abspath(os.fspath(dir))
    os.makedirs(os.path.join(dir, SUBDIR), exist_ok=True)
    import depyf

    stack = getattr(_active, "stack", None)
    if stack is None:
        stack = _active.stack = []
    with depyf.prepare_debug(dir):
        stack.append(dir)
        try:
            yield dir
        finally:
            stack.pop()
    logger.info("kvfuse: debug dumps written to %s", dir)


def _path(dir: str, name: str) -> str:
    os.makedirs(os.path.join(dir, SUBDIR), exist_ok=True)
    return os.path.join(dir, SUBDIR, name)


def write_graph(dir: str, label: str, graph) -> str:
    """Write ``graph`` (an FX graph) as readable Python to ``<dir>/kvfuse/<label>.py``."""
    path = _path(dir, f"{label}.py")
    code = graph.python_code("self").src
    with open(path, "w") as f:
        f.write(f"# kvfuse: {label}\n{code}")
    return path


def write_report(dir: str, name: str, payload) -> str:
    """Write ``payload`` (JSON-serialisable) to ``<dir>/kvfuse/<name>.json``."""
    path = _path(dir, f"{name}.json")
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2)
    os.replace(tmp, path)
    return path
