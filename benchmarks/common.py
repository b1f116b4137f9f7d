"""Shared timing and reporting helpers for kvfuse's GPU benchmarks.

Timing: every measured call is captured into a CUDA graph (several calls on rotating buffer sets
so that inputs are not served from L2), the graph is replayed between CUDA events, and the median
over trials is reported per call. Graphs take Python and launch overhead out of the number, as
engines that replay decode steps from graphs see it. A graph holds at least
:data:`MIN_GRAPH_CALLS` calls (the buffer sets in turn, again as needed): in an engine's step
graph a kernel follows another kernel, not a graph launch, and a graph of one large call would
count one graph launch per call. If a call cannot be captured, plain back-to-back launches are
timed instead and the result says so.

Results: :func:`write_results` writes ``<name>.json``, a markdown fragment ``<name>.md`` and,
when given a plot spec, ``<name>.png``. Other benchmark helpers may append functions at the END
of this file.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import statistics
import subprocess
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

L2_BYTES_FALLBACK = 50 * 2**20
#: Fewest calls one timing graph holds (since the eighteenth session; one per buffer set before).
MIN_GRAPH_CALLS = 8


@dataclass
class Timing:
    us: float  # median microseconds per call
    graphed: bool  # timed from a CUDA graph replay (False: plain launches)


def current_commit() -> str:
    """The commit being measured: env BENCH_COMMIT, else git's HEAD, with ``+dirty`` when tracked
    files differ from it. The device machine's copy of a working tree can carry a stale ``.git``
    (BENCHMARKS.md, twenty-fourth session), and uncommitted edits are not that commit either: the
    suffix says so."""
    commit = os.environ.get("BENCH_COMMIT", "").strip()
    if commit:
        return commit
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        clean = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], capture_output=True, timeout=30).returncode
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head if clean == 0 else f"{head}+dirty"


def device_info(command: str = "") -> dict:
    """Device name, UTC date, commit (env BENCH_COMMIT, else git), library versions, command."""
    info = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "commit": current_commit(),
        "torch": torch.__version__,
        "command": command,
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    return info


def l2_bytes() -> int:
    try:
        return int(torch.cuda.get_device_properties(0).L2_cache_size)
    except (AttributeError, RuntimeError):
        return L2_BYTES_FALLBACK


def rotations_for(bytes_per_call: int, max_sets: int = 16) -> int:
    """How many buffer sets a benchmark should rotate through so that they exceed 2x L2."""
    if bytes_per_call <= 0:
        return max_sets
    return max(1, min(max_sets, -(-2 * l2_bytes() // bytes_per_call)))


def _replays_for(graph: torch.cuda.CUDAGraph, min_ms: float) -> int:
    """Replays of ``graph`` that take about ``min_ms`` (at least one)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    torch.cuda.synchronize()
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return max(1, int(min_ms / max(start.elapsed_time(end), 1e-4)))


def _graph_sample(graph: torch.cuda.CUDAGraph, reps: int, calls_per_replay: int) -> float:
    """Microseconds per call over ``reps`` back-to-back replays of ``graph``."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * calls_per_replay)


def _capture(calls: Sequence[Callable[[], None]]) -> Optional[tuple[torch.cuda.CUDAGraph, int]]:
    """``calls`` (repeated to at least :data:`MIN_GRAPH_CALLS`) captured into one graph, after a
    warm-up on a side stream; None if they cannot be captured."""
    calls = [calls[i % len(calls)] for i in range(max(MIN_GRAPH_CALLS, len(calls)))]
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for fn in calls:
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for fn in calls:
                fn()
        return graph, len(calls)
    except Exception:  # noqa: BLE001 - a call that cannot be captured is timed without a graph
        torch.cuda.synchronize()
        return None


def _eager_sample(calls: Sequence[Callable[[], None]]) -> float:
    """Microseconds per call over plain back-to-back launches of ``calls``."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = max(1, 64 // len(calls))
    start.record()
    for _ in range(reps):
        for fn in calls:
            fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * len(calls))


def _sampler(calls: Sequence[Callable[[], None]], min_ms: float,
             use_graph: bool) -> tuple[Callable[[], float], bool]:
    """Warms ``calls`` up (compiling whatever they compile) and captures them (:func:`_capture`);
    returns a function that takes one sample, microseconds per call over about ``min_ms`` of graph
    replays (or over plain launches where they could not be captured), and whether it replays a
    graph."""
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    captured = _capture(calls) if use_graph else None
    if captured is None:
        return (lambda: _eager_sample(calls)), False
    graph, calls_per_replay = captured
    reps = _replays_for(graph, min_ms)
    return (lambda: _graph_sample(graph, reps, calls_per_replay)), True


def bench(calls: Sequence[Callable[[], None]], trials: int = 15, min_ms: float = 2.0,
          use_graph: bool = True) -> Timing:
    """Median microseconds of one call; ``calls[i]`` runs the op on buffer set ``i``.

    All calls are warmed up (compiling whatever they compile), then captured into one CUDA graph
    in order, repeated until it holds at least :data:`MIN_GRAPH_CALLS` calls.
    """
    sample, graphed = _sampler(calls, min_ms, use_graph)
    return Timing(statistics.median(sample() for _ in range(trials)), graphed)


def interleaved_order(names: Sequence[str], rounds: int) -> list[list[str]]:
    """The order of :func:`bench_interleaved`'s samples: one of each name per round, each round's
    list the one before rotated by one, so that over ``len(names)`` rounds every name takes every
    place in a round once."""
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: want at least 1")
    names = list(names)
    if len(set(names)) != len(names):
        raise ValueError(f"names {names}: want each once")
    n = len(names)
    return [[names[(r + i) % n] for i in range(n)] for r in range(rounds)]


@dataclass(frozen=True)
class InterleavedTimings:
    """What :func:`bench_interleaved` measured: per variant, microseconds per call, one sample per
    round, and whether it was timed from a CUDA graph."""

    samples: dict
    graphed: dict

    def median(self, name: str) -> float:
        return statistics.median(self.samples[name])

    def ratio(self, num: str, den: str) -> tuple[float, float, float]:
        """(median, lowest, highest) over rounds of ``num``'s sample over ``den``'s of the same
        round."""
        ratios = [a / b for a, b in zip(self.samples[num], self.samples[den])]
        return statistics.median(ratios), min(ratios), max(ratios)


def bench_interleaved(variants: "dict[str, Sequence[Callable[[], None]]]", rounds: int = 15,
                      min_ms: float = 2.0, use_graph: bool = True) -> InterleavedTimings:
    """Each variant's calls timed as :func:`bench` times them, but sampled in turn: round r takes
    one sample (about ``min_ms`` of replays) of every variant, in :func:`interleaved_order`.

    Every variant is warmed up and captured before the first sample, so a level shift of the
    machine during the run falls on all variants of a round alike, and a ratio taken per round
    (:meth:`InterleavedTimings.ratio`) cancels it where medians from separate runs do not. It does
    not cancel a level that a graph takes from its capture: the rotary write's 32- and 64-token
    graphs ran at a second level, with the write alone's graph captured beside them, after
    warm-ups on some of PyTorch's pooled streams (BENCHMARKS.md, fifty-sixth session).
    """
    samplers = {name: _sampler(calls, min_ms, use_graph) for name, calls in variants.items()}
    samples = {name: [] for name in variants}
    for order in interleaved_order(list(variants), rounds):
        for name in order:
            samples[name].append(samplers[name][0]())
    return InterleavedTimings(samples, {name: graphed for name, (_, graphed) in samplers.items()})


_COPY_KERNEL = None


def _triton_copy(src: torch.Tensor, dst: torch.Tensor) -> None:
    """A plain 16-byte-vector Triton copy: what a well-formed streaming kernel can reach."""
    global _COPY_KERNEL
    import triton
    import triton.language as tl

    if _COPY_KERNEL is None:
        @triton.jit
        def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)

        _COPY_KERNEL = _copy_kernel
    n = src.numel()
    _COPY_KERNEL[(triton.cdiv(n, 4096),)](src, dst, n, BLOCK=4096, num_warps=8)


def copy_bandwidths(nbytes: int = 1 << 30, trials: int = 15) -> dict:
    """Device-to-device copy bandwidth by method, in GB/s of bytes read + bytes written."""
    src = torch.empty(nbytes // 4, dtype=torch.int32, device="cuda").random_(0, 1 << 30)
    dst = torch.empty_like(src)
    methods = {
        "torch copy_ (cudaMemcpy)": lambda: dst.copy_(src),
        "torch elementwise (bitwise_or 0)": lambda: torch.bitwise_or(src, 0, out=dst),
        "triton 16-byte copy": lambda: _triton_copy(src, dst),
    }
    out = {}
    for name, fn in methods.items():
        try:
            out[name] = 2 * nbytes / (bench([fn], trials=trials, min_ms=20.0).us * 1e-6) / 1e9
        except Exception:  # noqa: BLE001 - a method that cannot run is left out
            continue
    del src, dst
    torch.cuda.empty_cache()
    return out


def copy_bandwidth_gb_s(nbytes: int = 1 << 30, trials: int = 15) -> float:
    """The device-to-device copy ceiling: the best of :func:`copy_bandwidths`."""
    return max(copy_bandwidths(nbytes, trials).values())


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
        f.write("\n")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_markdown(path: str, title: str, info: dict, body: str, notes: Sequence[str] = ()) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    head = (f"### {title}\n\n{info.get('date')} on {info.get('device')}, commit `{info.get('commit')}`, "
            f"torch {info.get('torch')}, triton {info.get('triton', 'n/a')}.\n"
            f"Command: `{info.get('command')}`\n\n")
    tail = "".join(f"\n- {n}" for n in notes)
    with open(path, "w") as f:
        f.write(head + body + "\n" + (tail + "\n" if tail else ""))


def pyplot(path: str):
    """``matplotlib.pyplot`` (Agg backend), or None with a note on stderr when matplotlib is not
    installed: plots are optional, the results (JSON, markdown, stdout) are written anyway."""
    try:
        import matplotlib
    except ImportError:
        import sys

        print(f"note: plot {path} skipped: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_lines(path: str, series: dict, title: str, xlabel: str, ylabel: str,
               hline: Optional[tuple[float, str]] = None, panels: Optional[Sequence[str]] = None) -> None:
    """PNG of ``series[panel][label] = [(x, y), ...]`` with log2 x, one subplot per panel."""
    plt = pyplot(path)
    if plt is None:
        return

    panels = list(panels or series)
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for label, points in sorted(series.get(panel, {}).items()):
            if points:
                xs, ys = zip(*sorted(points))
                ax.plot(xs, ys, marker="o", label=label)
        if hline is not None:
            ax.axhline(hline[0], color="k", linestyle="--", linewidth=1, label=hline[1])
        ax.set_xscale("log", base=2)
        ax.set_title(f"{title}: {panel}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- cold-L2 timing

_flush_buf = None


def flush_l2():
    global _flush_buf
    if _flush_buf is None:
        _flush_buf = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    _flush_buf.zero_()


def _time_graph_cold_l2(fn, reps):
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        for _ in range(reps):
            flush_l2()
            fn()
    flush_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(flush_graph):
        for _ in range(reps):
            flush_l2()
    times = []
    for g in (graph, flush_graph, graph, flush_graph, graph, flush_graph):
        g.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return min(times[0::2]) - min(times[1::2])


def _time_eager_cold_l2(fn, reps):
    fn()
    torch.cuda.synchronize()
    best = []
    for _ in range(3):
        torch.cuda.synchronize()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        ev[0].record()
        for _ in range(reps):
            flush_l2()
            fn()
        ev[1].record()
        ev[2].record()
        for _ in range(reps):
            flush_l2()
        ev[3].record()
        torch.cuda.synchronize()
        best.append((ev[0].elapsed_time(ev[1]) - ev[2].elapsed_time(ev[3])) * 1e3 / reps)
    return min(best)


def bench_cold_l2(fn, reps=20, graph=True):
    """Microseconds per call of ``fn`` (L2 flushed before each call, flush time subtracted)."""
    if graph:
        try:
            return _time_graph_cold_l2(fn, reps), "graph"
        except Exception:  # capture unsupported by this implementation: fall back to launches
            torch.cuda.synchronize()
    return _time_eager_cold_l2(fn, reps), "eager"


def tile_fields(specs: Sequence[str]) -> dict:
    """Tile fields given on a benchmark's command line (``--tile FIELD=VALUE``, repeatable): VALUE
    an integer (booleans as 0 / 1), ``none``, or a word for the fields that take one
    (``GRID_ORDER``, checked when the tile is built); FIELD one of
    :class:`kvfuse.ops.triton.attention.Tile`'s."""
    import dataclasses

    from kvfuse.ops.triton.attention import Tile

    words = {f.name for f in dataclasses.fields(Tile) if f.type in (str, "str")}
    allowed = sorted(f.name for f in dataclasses.fields(Tile))
    fields = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        if not sep or name not in allowed:
            raise ValueError(f"--tile {spec!r}: expected FIELD=VALUE with FIELD one of {', '.join(allowed)}")
        if value.lower() == "none":
            fields[name] = None
        elif re.fullmatch(r"-?\d+", value):
            fields[name] = int(value)
        elif name in words:
            fields[name] = value
        else:
            raise ValueError(f"--tile {spec!r}: VALUE must be an integer (0 / 1 for switches) or none "
                             f"(a word only for {', '.join(sorted(words))})")
    return fields
