"""``kvfuse.backend`` / ``kvfuse.make_backend``: Inductor with kvfuse's fusion, plus a report.

A backend object is what ``torch.compile(model, backend=...)`` calls once per captured
(sub)graph. It compiles with Inductor, installing :class:`kvfuse.passes.KVFusePassManager` as
``post_grad_custom_post_pass`` through ``compile_fx``'s ``config_patches``: the pass is active
for that compile only and never touches the global Inductor config.

The report (:attr:`KVFuseBackend.report`): one :class:`~kvfuse.passes.FusionRecord`
(``layer_name``, ``kv_quant_mode``, ``fused``, ``reason``) per cache write of the last compiled
graph, in graph order. "Last compiled graph" means every subgraph Dynamo compiled for the last
top-level frame it compiled with this backend: a compile started from plain Python (a first
call, a recompile after a guard failed, another model) starts a new report; subgraphs that
Dynamo compiles while running already compiled code (resume functions after a graph break,
functions called from a compiled frame) add to the current one. The previous report object is
left untouched, so keep a reference to compare.

Inductor's caches: when a graph is served from the FX graph cache or the AOTAutograd cache the
passes do not run. The records of each compiled graph are therefore stored beside Inductor's
cache (``<inductor cache dir>/kvfuse_reports``) under a key of the Dynamo graph, its input
metadata and the pass manager's ``uuid()``, and read back on a hit; if they are missing, the
graph is compiled once more with the caches off so the report is never guessed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from typing import Any, Optional

from .kv_cache import KVQuantMode

logger = logging.getLogger(__name__)

__all__ = ["KVFuseBackend", "make_backend", "backend"]

_RESERVED_OPTIONS = ("post_grad_custom_post_pass",)


def _input_meta(x: Any) -> str:
    import torch

    if isinstance(x, torch.Tensor):
        return f"T({x.dtype},{x.device.type},{tuple(x.shape)},{tuple(x.stride())})"
    return f"{type(x).__name__}({x})"


def _compiling_inside_compiled_code() -> bool:
    """True if Dynamo is compiling because already compiled code reached a new frame.

    That is the case for resume functions after a graph break and for frames called from a
    compiled frame: the caller's frame then runs Dynamo's transformed bytecode.
    """
    try:
        from torch._dynamo.convert_frame import output_codes
    except ImportError:  # pragma: no cover - private API moved
        return False
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in output_codes:
            return True
        frame = frame.f_back
    return False


class KVFuseBackend:
    """A ``torch.compile`` backend: Inductor + kvfuse's passes, with a fusion report.

    ``fuse=False`` compiles the same graph without kvfuse's rewrite (the baseline); the report
    then says, per cache write, what would have been fused. Other keyword arguments are
    Inductor config options applied to this backend's compiles only (e.g.
    ``triton.cudagraphs=True`` as ``**{"triton.cudagraphs": True}``).
    """

    def __init__(self, fuse: bool = True, **inductor_options: Any) -> None:
        if not isinstance(fuse, bool):
            raise ValueError(f"fuse={fuse!r} must be a bool (True: fuse encode+cache write; False: baseline)")
        for name in _RESERVED_OPTIONS:
            if name in inductor_options:
                raise ValueError(f"inductor option {name!r} is set by kvfuse for its own passes; "
                                 f"chain your pass after compiling or drop it")
        self.fuse = fuse
        self.inductor_options = dict(inductor_options)
        self.report: list = []
        self.last_compile: dict = {}
        self._manager = None
        self._options_checked = False
        if self.inductor_options:  # fail at configuration time; without options Inductor stays unimported
            self._check_options()

    @property
    def pass_manager(self):
        """The :class:`kvfuse.passes.KVFusePassManager` (created on first use: importing
        Inductor is heavy, and ``import kvfuse`` must stay light)."""
        if self._manager is None:
            from .passes import KVFusePassManager

            self._manager = KVFusePassManager(fuse=self.fuse)
        return self._manager

    def _check_options(self) -> None:
        if self._options_checked:
            return
        from torch._inductor import config

        known = getattr(config, "_config", None)
        unknown = sorted(n for n in self.inductor_options
                         if not (n in known if known is not None else hasattr(config, n)))
        if unknown:
            raise ValueError(f"unknown Inductor option(s) {unknown} passed to kvfuse.make_backend; "
                             f"see torch._inductor.config for the valid names")
        self._options_checked = True

    def config_patches(self) -> dict:
        return {**self.inductor_options, "post_grad_custom_post_pass": self.pass_manager}

    # -------------------------------------------------------------------------------- report store

    def _report_key(self, gm, example_inputs) -> str:
        h = hashlib.sha256()
        h.update(self.pass_manager.uuid().encode())
        h.update(json.dumps(sorted((k, repr(v)) for k, v in self.inductor_options.items())).encode())
        h.update(gm.code.encode())
        for x in example_inputs:
            h.update(_input_meta(x).encode())
        return h.hexdigest()

    @staticmethod
    def _store_dir() -> str:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        return os.path.join(cache_dir(), "kvfuse_reports")

    def _save(self, key: str, records: list) -> None:
        try:
            path = os.path.join(self._store_dir(), f"{key}.json")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump([r.as_dict() for r in records], f)
            os.replace(tmp, path)
        except OSError as e:  # a read-only cache dir costs a recompile on a later hit, no more
            logger.warning("kvfuse: could not store the fusion report: %s", e)

    def _load(self, key: str) -> Optional[list]:
        from .passes import FusionRecord

        path = os.path.join(self._store_dir(), f"{key}.json")
        try:
            with open(path) as f:
                raw = json.load(f)
        except (OSError, ValueError):
            return None
        out = []
        for r in raw:
            mode = r["kv_quant_mode"]
            mode = KVQuantMode[mode] if isinstance(mode, str) and mode in KVQuantMode.__members__ else mode
            out.append(FusionRecord(r["layer_name"], mode, bool(r["fused"]), r["reason"]))
        return out

    # -------------------------------------------------------------------------------- compile

    def __call__(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        from . import debug

        self._check_options()
        manager = self.pass_manager
        if not _compiling_inside_compiled_code():
            self.report = []
        manager.take()  # drop anything a failed earlier compile left behind
        key = self._report_key(gm, example_inputs)
        start = time.perf_counter()
        compiled = compile_fx(gm, example_inputs, config_patches=self.config_patches())
        records, graphs, pass_seconds = manager.take()
        source = "passes"
        if graphs == 0:
            stored = self._load(key)
            if stored is not None:
                records, source = stored, "stored report (Inductor cache hit)"
            else:
                logger.info("kvfuse: graph served from Inductor's cache without a stored report; "
                            "compiling it again with caches off to know what was fused")
                compiled = compile_fx(gm, example_inputs, config_patches={
                    **self.config_patches(), "force_disable_caches": True})
                records, graphs, pass_seconds = manager.take()
                source = "passes (recompiled, caches off)"
        if graphs:
            self._save(key, records)
        seconds = time.perf_counter() - start
        self.report.extend(records)
        self.last_compile = {"records": len(records), "fused": sum(r.fused for r in records),
                             "compile_seconds": seconds, "pass_seconds": pass_seconds,
                             "graphs_processed": graphs, "report_source": source}
        logger.debug("kvfuse backend: %d cache writes (%d fused) from %s; compile %.3f s, kvfuse passes %.3f ms",
                     len(records), self.last_compile["fused"], source, seconds, 1e3 * pass_seconds)
        dump_dir = debug.active_dump_dir()
        if dump_dir:
            debug.write_report(dump_dir, "report", {"fuse": self.fuse, "records": [r.as_dict() for r in self.report]})
        return compiled

    def __repr__(self) -> str:
        opts = "".join(f", {k}={v!r}" for k, v in self.inductor_options.items())
        return f"KVFuseBackend(fuse={self.fuse}{opts})"


def make_backend(fuse: bool = True, **inductor_options: Any) -> KVFuseBackend:
    """A new :class:`KVFuseBackend` (its own report); see the module docstring."""
    return KVFuseBackend(fuse=fuse, **inductor_options)


backend = make_backend()
