"""kvfuse's Inductor pass manager: runs the fusion passes and keeps what they decided.

Installed per compile (never globally) as ``torch._inductor.config.post_grad_custom_post_pass``
by :class:`kvfuse.backend.KVFuseBackend`. Why the *post* hook: it runs after Inductor's own
post-grad clean-up (no-op ``.to()``/clone removal, its pattern passes), so the plain-PyTorch
encodings arrive in one canonical ATen form, and still before ``reinplace_inplaceable_ops``
and the decomposition of ``auto_functionalized``, so the fused write is reinplaced by Inductor
like any other mutating custom op (no copy of the cache is left; tests/compile prove it).

``uuid()`` is :func:`hash_source` of every pass file (and of the op schemas and dtype model
they read) together with the options, so Inductor's FX graph cache stays on and is never served
a graph compiled by other pass code or other options.

Records. Every decision is also counted in ``torch._dynamo.utils.counters["inductor"]`` under a
key holding the record (:data:`RECORD_PREFIX`): Inductor stores a graph's counter increments
with its cache entry and replays them on a hit, so :func:`take_replayed` gives the
backend the records of a graph whose passes did not run.
"""

from __future__ import annotations

import glob
import hashlib
import itertools
import json
import logging
import os
import time

import torch.fx as fx
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass

from ..kv_cache import KVQuantMode
from . import fuse_encode_cache_write, fuse_plain_cache_write, fuse_rope_cache_write
from .fuse_encode_cache_write import FusionRecord

logger = logging.getLogger(__name__)

# A pass with AMENDS_RECORDS = True gets the records of the passes before it and returns them
# amended (one record per cache write stays one record).
_PASSES = (fuse_encode_cache_write, fuse_plain_cache_write, fuse_rope_cache_write)
_DUMP_COUNTER = itertools.count()
#: Counter keys of fusion records: ``<prefix><index in graph>/<json record>``.
RECORD_PREFIX = "kvfuse.fusion_record/"
#: Counter keys of the notes on a graph without any cache write: ``<prefix><index>/<json line>``.
NOTE_PREFIX = "kvfuse.fusion_note/"


def _source_files() -> tuple[str, ...]:
    here = os.path.dirname(os.path.abspath(__file__))
    package = os.path.dirname(here)
    return tuple(sorted(glob.glob(os.path.join(here, "*.py")))) + (
        os.path.join(package, "ops", "library.py"),
        os.path.join(package, "kv_cache.py"),
    )


def hash_source(*paths: str) -> str:
    """sha256 over the contents of ``paths``, in order (a pass's identity for Inductor's caches)."""
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def _count(records: list, notes: list) -> None:
    for i, record in enumerate(records):
        counters["inductor"][f"{RECORD_PREFIX}{i:06d}/{json.dumps(record.as_dict(), sort_keys=True)}"] += 1
    for i, note in enumerate(notes):
        counters["inductor"][f"{NOTE_PREFIX}{i:06d}/{json.dumps(note)}"] += 1


def _take_counted(prefix: str) -> list:
    inductor = counters["inductor"]
    keys = sorted(k for k in inductor if k.startswith(prefix))
    for key in keys:
        del inductor[key]
    return [json.loads(key.split("/", 2)[2]) for key in keys]


def take_replayed() -> tuple[list, list]:
    """(records, notes) counted since the last call (by the passes, or replayed from Inductor's
    cache), in graph order; removes them from the counters."""
    records = []
    for raw in _take_counted(RECORD_PREFIX):
        mode = raw["kv_quant_mode"]
        mode = KVQuantMode[mode] if isinstance(mode, str) and mode in KVQuantMode.__members__ else mode
        records.append(FusionRecord(raw["layer_name"], mode, bool(raw["fused"]), raw["reason"]))
    return records, _take_counted(NOTE_PREFIX)


class KVFusePassManager(CustomGraphPass):
    """Runs kvfuse's post-grad passes on each graph Inductor compiles and collects records.

    ``fuse=False`` runs the same analysis without rewriting (the baseline graph, still with a
    report saying what would have been fused). ``fuse_rotary=False`` fuses the encodes and writes
    but leaves every rotation to Inductor (its records say what would have been fused).
    """

    def __init__(self, fuse: bool = True, fuse_rotary: bool = True) -> None:
        if not isinstance(fuse, bool):
            raise ValueError(f"fuse={fuse!r} must be a bool")
        if not isinstance(fuse_rotary, bool):
            raise ValueError(f"fuse_rotary={fuse_rotary!r} must be a bool")
        self.fuse = fuse
        self.fuse_rotary = fuse_rotary
        self._records: list = []
        self._notes: list = []
        self._invocations = 0
        self._seconds = 0.0

    def options(self) -> dict:
        return {"fuse": self.fuse, "fuse_rotary": self.fuse_rotary, "passes": [p.NAME for p in _PASSES]}

    def uuid(self) -> str:
        # Hashed here rather than with Inductor's get_hash_for_files, which memoises per path list.
        options = json.dumps(self.options(), sort_keys=True)
        return hashlib.sha256((options + hash_source(*_source_files())).encode()).hexdigest()

    def __call__(self, graph: fx.Graph) -> None:
        from .. import debug

        dump_dir = debug.active_dump_dir()
        start = time.perf_counter()
        graph_records: list = []
        for p in _PASSES:
            seq = next(_DUMP_COUNTER) if dump_dir else None
            if dump_dir:
                debug.write_graph(dump_dir, f"{seq:03d}_{p.NAME}.before", graph)
            t0 = time.perf_counter()
            if getattr(p, "AMENDS_RECORDS", False):
                switch = {"enabled": self.fuse_rotary} if p is fuse_rope_cache_write else {}
                graph_records = p.run(graph, fuse=self.fuse, records=graph_records, **switch)
                records = []
            else:
                records = p.run(graph, fuse=self.fuse)
            if self.fuse and any(r.fused for r in records + graph_records):
                graph.lint()
            logger.debug("pass %s: %d cache writes, %d fused, %.3f ms", p.NAME, len(graph_records) + len(records),
                         sum(r.fused for r in records + graph_records), 1e3 * (time.perf_counter() - t0))
            if dump_dir:
                debug.write_graph(dump_dir, f"{seq:03d}_{p.NAME}.after", graph)
            graph_records.extend(records)
        self._records.extend(graph_records)
        # A graph with no cache write at all: say why, in lines a user can act on.
        notes = [] if graph_records else fuse_plain_cache_write.explain_no_writes(graph)
        self._notes.extend(notes)
        _count(graph_records, notes)
        self._invocations += 1
        self._seconds += time.perf_counter() - start

    def take(self) -> tuple[list, int, float]:
        """(records, number of graphs processed, seconds spent) since the last take; resets them
        (and the notes: see :meth:`take_notes`)."""
        out = (self._records, self._invocations, self._seconds)
        self._records, self._notes, self._invocations, self._seconds = [], [], 0, 0.0
        return out

    def take_notes(self) -> list:
        """Lines on the graphs without any cache write since the last take (one per reason)."""
        out, self._notes = self._notes, []
        return out

    def __repr__(self) -> str:
        return f"KVFusePassManager(fuse={self.fuse}, fuse_rotary={self.fuse_rotary})"


def graph_op_counts(graph: fx.Graph) -> dict:
    """Counts of kvfuse ops in ``graph`` (functionalized writes counted by their inner op)."""
    counts: dict = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        if getattr(target, "__name__", "").startswith("auto_functionalized") and node.args:
            target = node.args[0]
        name = str(target)
        if name.startswith("kvfuse."):
            key = name.split(".")[1]
            counts[key] = counts.get(key, 0) + 1
    return counts
