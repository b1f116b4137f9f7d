"""``kvfuse.backend`` / ``kvfuse.make_backend``: Inductor with kvfuse's fusion, plus a report.

A backend object is what ``torch.compile(model, backend=...)`` calls once per captured
(sub)graph. It compiles with Inductor, installing :class:`kvfuse.passes.KVFusePassManager` as
``post_grad_custom_post_pass`` through ``compile_fx``'s ``config_patches``: the pass is active
for that compile only and never touches the global Inductor config.

Reports come from the pass's own records. Each compiled graph gets a :class:`GraphReport`
(its Dynamo compile id, one :class:`~kvfuse.passes.FusionRecord` per cache write in graph
order, and where the records came from), kept per backend instance in :attr:`KVFuseBackend.reports`.
:attr:`KVFuseBackend.report` is the list of records of the last *compile*: the graphs Dynamo
compiled for one frame and for the functions Dynamo made to resume it after graph breaks
(recognised by their ``torch_dynamo_resume_in_`` names in the graph's stack traces); any other
graph starts a new list (another model, a recompile, a function compiled on its own), so one
backend shared by two models never mixes their records. The previous list object is left untouched, so keep a reference to compare.

Inductor's caches: when a graph is served from the FX graph or AOTAutograd cache the passes do
not run, but Inductor replays the counter increments recorded when the entry was compiled
(``counter_deltas``; that is how its own tests see pass counts with caching on). The pass
manager records each fusion decision as such a counter, so a cache hit reports exactly what the
passes decided when the entry was made: no side store, no second compile. While a dump is
active (:mod:`kvfuse.debug`) caches are bypassed so the pass graphs are always written.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Optional

logger = logging.getLogger(__name__)

__all__ = ["KVFuseBackend", "GraphReport", "make_backend", "backend"]

_RESERVED_OPTIONS = ("post_grad_custom_post_pass",)
_MAX_REPORTS = 256


@dataclass(frozen=True)
class GraphReport:
    """What kvfuse did in one compiled graph: ``compile_id`` (Dynamo's ``frame/compile``),
    ``records`` (one per cache write, graph order), ``source`` (``"passes"``, or the cache entry
    the records were replayed from), ``seconds`` (compile time, kvfuse passes included) and
    ``notes`` (a graph with no cache write at all: why, one line per reason)."""

    compile_id: str
    records: tuple
    source: str
    seconds: float
    notes: tuple = ()  # for a graph with no cache write: why, one line per reason


def _compile_id(gm) -> tuple[Optional[int], str]:
    cid = getattr(gm, "meta", {}).get("dynamo_compile_id")
    frame = getattr(cid, "frame_id", None)
    return frame, str(cid) if cid is not None else "?"


# Dynamo names the code objects it creates to resume a frame after a graph break with this
# prefix; the nodes of such a graph carry it in their stack traces.
_RESUME_PREFIX = "torch_dynamo_resume_in_"


def _is_resumption(gm) -> bool:
    for node in gm.graph.nodes:
        trace = node.meta.get("stack_trace")
        if trace:
            return f"in {_RESUME_PREFIX}" in trace
    return False


class KVFuseBackend:
    """A ``torch.compile`` backend: Inductor + kvfuse's passes, with a fusion report.

    ``fuse=False`` compiles the same graph without kvfuse's rewrite (the baseline); the report
    then says, per cache write, what would have been fused. ``fuse_rotary=False`` keeps the
    encode and cache-write fusion but leaves each layer's rotary embedding to Inductor (to bisect
    a difference, or to time what the rotary fusion buys); the report says per layer what it would
    have fused. Other keyword arguments are
    Inductor config options applied to this backend's compiles only (e.g.
    ``triton.cudagraphs=True`` as ``**{"triton.cudagraphs": True}``).
    """

    def __init__(self, fuse: bool = True, fuse_rotary: bool = True, **inductor_options: Any) -> None:
        if not isinstance(fuse, bool):
            raise ValueError(f"fuse={fuse!r} must be a bool (True: fuse encode+cache write; False: baseline)")
        if not isinstance(fuse_rotary, bool):
            raise ValueError(f"fuse_rotary={fuse_rotary!r} must be a bool (True: fuse each layer's rotary "
                             f"embedding into its cache write where recognised; False: leave it to Inductor)")
        for name in _RESERVED_OPTIONS:
            if name in inductor_options:
                raise ValueError(f"inductor option {name!r} is set by kvfuse for its own passes; "
                                 f"chain your pass after compiling or drop it")
        self.fuse = fuse
        self.fuse_rotary = fuse_rotary
        self.inductor_options = dict(inductor_options)
        self.report: list = []
        self.notes: list = []  # the current report's lines on graphs without any cache write
        self.reports: list[GraphReport] = []
        self.last_compile: dict = {}
        self._report_frames: set = set()
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

            self._manager = KVFusePassManager(fuse=self.fuse, fuse_rotary=self.fuse_rotary)
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

    # -------------------------------------------------------------------------------- compile

    def __call__(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        from . import debug
        from .passes import manager as pass_manager

        self._check_options()
        manager = self.pass_manager
        manager.take()  # drop anything a failed earlier compile left behind
        pass_manager.take_replayed()
        patches = self.config_patches()
        dump_dir = debug.active_dump_dir()
        if dump_dir:  # a cache hit would skip the passes, and so their graphs
            patches["force_disable_caches"] = True
        start = time.perf_counter()
        compiled = compile_fx(gm, example_inputs, config_patches=patches)
        seconds = time.perf_counter() - start
        notes = manager.take_notes()
        records, graphs, pass_seconds = manager.take()
        replayed, replayed_notes = pass_manager.take_replayed()
        if graphs:
            source = "passes"
        else:
            records, notes = replayed, replayed_notes
            source = "stored report (replayed from Inductor's cache entry)"
        frame, compile_id = _compile_id(gm)
        self._add(GraphReport(compile_id, tuple(records), source, seconds, tuple(notes)), frame, _is_resumption(gm))
        self.last_compile = {"records": len(records), "fused": sum(r.fused for r in records),
                             "compile_seconds": seconds, "pass_seconds": pass_seconds,
                             "graphs_processed": graphs, "report_source": source, "compile_id": compile_id}
        logger.debug("kvfuse backend: graph %s, %d cache writes (%d fused) from %s; compile %.3f s, "
                     "kvfuse passes %.3f ms", compile_id, len(records), self.last_compile["fused"], source,
                     seconds, 1e3 * pass_seconds)
        if dump_dir:
            debug.write_report(dump_dir, "report", {"fuse": self.fuse, "records": [r.as_dict() for r in self.report],
                                                    "notes": list(self.notes)})
        return compiled

    def _add(self, graph_report: GraphReport, frame: Optional[int], resumption: bool) -> None:
        # Only a frame resumed after a graph break, compiled for the first time in this report,
        # continues it (see the module docstring).
        if not resumption or frame is None or frame in self._report_frames:
            self.report = []
            self.notes = []
            self._report_frames = set()
        if frame is not None:
            self._report_frames.add(frame)
        self.report.extend(graph_report.records)
        self.notes.extend(graph_report.notes)
        self.reports.append(graph_report)
        del self.reports[:-_MAX_REPORTS]

    def __repr__(self) -> str:
        opts = "".join(f", {k}={v!r}" for k, v in self.inductor_options.items())
        rotary = "" if self.fuse_rotary else ", fuse_rotary=False"
        return f"KVFuseBackend(fuse={self.fuse}{rotary}{opts})"


def make_backend(fuse: bool = True, fuse_rotary: bool = True, **inductor_options: Any) -> KVFuseBackend:
    """A new :class:`KVFuseBackend` (its own report); see the module docstring."""
    return KVFuseBackend(fuse=fuse, fuse_rotary=fuse_rotary, **inductor_options)


backend = make_backend()
