"""Tensor parallelism for kvfuse models: head sharding, parallel linears, collectives, reports.

Layout (the Megatron/vLLM scheme): every rank holds ``num_heads / tp_size`` query heads of
every attention layer and the KV heads they read, and its own paged cache of those KV heads
only. Projections into heads (QKV, MLP gate/up) are column-parallel: each rank computes its
own output columns from the full input, so no communication. Projections out of heads (the
attention output, MLP down) are row-parallel: each rank multiplies its slice of the input
features and one all-reduce sums the partial results.

KV heads: with ``tp_size <= num_kv_heads`` rank r holds heads ``[r * n, (r + 1) * n)``,
``n = num_kv_heads / tp_size``. With ``tp_size > num_kv_heads`` there are too few KV heads to
split, so each rank holds exactly one, replicated on ``tp_size / num_kv_heads`` consecutive
ranks (rank r holds head ``r // (tp_size / num_kv_heads)``): those ranks' query heads all
belong to that KV head's group, so each rank still attends only to heads it holds. Any other
combination is refused.

Each KV head is quantized on its own (FP8: per-tensor scale; NVFP4: per-16-element block
scales and a per-tensor global scale), so splitting heads over ranks stores exactly the same
cache rows as one rank would: tensor parallelism changes where a head lives, never its
encoding.

Communication is torch.distributed's: process groups (gloo on CPU, NCCL on GPU) and, inside
models, the functional collectives, which ``torch.compile`` traces into the graph (Inductor
then schedules them like any other node).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import nn

logger = logging.getLogger(__name__)

__all__ = [
    "TensorParallel",
    "kv_head_shard",
    "shard_rows",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "all_reduce",
    "init_tensor_parallel",
    "shutdown_tensor_parallel",
    "gather_reports",
    "compare_reports",
]


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}")


def kv_head_shard(num_kv_heads: int, tp_size: int, rank: int) -> range:
    """The global KV-head indices rank ``rank`` of ``tp_size`` holds (see the module docstring).

    Raises ``ValueError`` naming both counts when neither divides the other.
    """
    _check_int("num_kv_heads", num_kv_heads, 1)
    _check_int("tp_size", tp_size, 1)
    _check_int("tp_rank", rank, 0)
    if rank >= tp_size:
        raise ValueError(f"tp_rank={rank} must be < tp_size={tp_size}")
    if num_kv_heads % tp_size == 0:
        per_rank = num_kv_heads // tp_size
        return range(rank * per_rank, (rank + 1) * per_rank)
    if tp_size % num_kv_heads == 0:
        replicas = tp_size // num_kv_heads
        head = rank // replicas
        return range(head, head + 1)
    raise ValueError(
        f"num_kv_heads={num_kv_heads} cannot be split over tp_size={tp_size}: one must divide the other "
        f"(tp_size dividing num_kv_heads shards the heads; num_kv_heads dividing tp_size replicates each "
        f"head on tp_size / num_kv_heads ranks)"
    )


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group: ``tp_size`` ranks, this one is ``rank``."""

    tp_size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        _check_int("tp_size", self.tp_size, 1)
        _check_int("rank", self.rank, 0)
        if self.rank >= self.tp_size:
            raise ValueError(f"TensorParallel: rank={self.rank} must be < tp_size={self.tp_size}")

    @classmethod
    def from_group(cls, group=None) -> "TensorParallel":
        """The layout of an initialized process group (``None``: the default group)."""
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("TensorParallel.from_group needs an initialized torch.distributed process group "
                               "(torch.distributed.init_process_group, or launch with torchrun)")
        return cls(tp_size=dist.get_world_size(group), rank=dist.get_rank(group))

    def split(self, total: int, what: str) -> range:
        """This rank's contiguous share of ``total`` items (query heads, MLP features...)."""
        _check_int(what, total, 1)
        if total % self.tp_size:
            raise ValueError(f"{what}={total} is not divisible by tp_size={self.tp_size}; every rank must hold "
                             f"an equal share")
        n = total // self.tp_size
        return range(self.rank * n, (self.rank + 1) * n)

    def kv_heads(self, num_kv_heads: int) -> range:
        return kv_head_shard(num_kv_heads, self.tp_size, self.rank)

    def kv_head_replicas(self, num_kv_heads: int) -> int:
        """How many ranks hold each KV head (1 unless ``tp_size > num_kv_heads``)."""
        kv_head_shard(num_kv_heads, self.tp_size, self.rank)
        return max(1, self.tp_size // num_kv_heads)


def shard_rows(items: range, width: int = 1) -> torch.Tensor:
    """Weight-row indices of ``items`` (heads, features) that are ``width`` rows each."""
    return torch.arange(items.start * width, items.stop * width)


class ColumnParallelLinear(nn.Linear):
    """``y = x @ W[rows].T``: this rank's output features of a bias-free linear, no communication.

    ``rows`` (int64 indices into the full weight's rows) may be non-contiguous, so one fused
    projection such as QKV takes its q, k and v heads from three places of the full weight.
    """

    def __init__(self, in_features: int, full_out_features: int, rows: torch.Tensor,
                 device=None, dtype=None) -> None:
        rows = torch.as_tensor(rows, dtype=torch.int64).flatten()
        if rows.numel() == 0 or rows.min() < 0 or rows.max() >= full_out_features:
            raise ValueError(f"rows must be non-empty indices into the {full_out_features} output features, got "
                             f"{rows.numel()} rows spanning {rows.min().item() if rows.numel() else None}.."
                             f"{rows.max().item() if rows.numel() else None}")
        super().__init__(in_features, rows.numel(), bias=False, device=device, dtype=dtype)
        self.full_shape = (full_out_features, in_features)
        self.register_buffer("_rows", rows, persistent=False)

    @torch.no_grad()
    def load_full_weight(self, full: torch.Tensor) -> None:
        if tuple(full.shape) != self.full_shape:
            raise ValueError(f"full weight has shape {tuple(full.shape)}, expected {self.full_shape}")
        self.weight.copy_(full.index_select(0, self._rows.to(full.device)))


class RowParallelLinear(nn.Linear):
    """``y = all_reduce(x_local @ W[:, cols].T)``: this rank's slice of the input features.

    ``x_local`` holds only the input features ``cols`` (what a column-parallel layer before
    it produced); the all-reduce over ``group`` sums every rank's partial product into the
    full output, identical on all ranks.
    """

    def __init__(self, full_in_features: int, out_features: int, cols: range, tp: TensorParallel,
                 group=None, device=None, dtype=None) -> None:
        if not isinstance(cols, range) or cols.step != 1 or not 0 <= cols.start < cols.stop <= full_in_features:
            raise ValueError(f"cols={cols!r} must be a contiguous non-empty range inside 0..{full_in_features}")
        super().__init__(len(cols), out_features, bias=False, device=device, dtype=dtype)
        self.full_shape = (out_features, full_in_features)
        self.cols = cols
        self.tp = tp
        self.group = group

    @torch.no_grad()
    def load_full_weight(self, full: torch.Tensor) -> None:
        if tuple(full.shape) != self.full_shape:
            raise ValueError(f"full weight has shape {tuple(full.shape)}, expected {self.full_shape}")
        self.weight.copy_(full[:, self.cols.start:self.cols.stop])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(super().forward(x), self.tp, self.group)


def all_reduce(x: torch.Tensor, tp: TensorParallel, group=None) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel group (identity at ``tp_size == 1``).

    The functional collective, so that ``torch.compile`` keeps it in the graph
    (``_c10d_functional.all_reduce`` + ``wait_tensor``) instead of breaking the graph there.
    """
    if tp.tp_size == 1:
        return x
    if group is None:
        raise RuntimeError(f"all_reduce over tp_size={tp.tp_size} ranks needs a process group; build the model "
                           f"with tp_group= (or after torch.distributed.init_process_group)")
    import torch.distributed._functional_collectives as funcol

    out = funcol.all_reduce(x, "sum", group)
    # Eager mode hands back an AsyncCollectiveTensor that waits on first use; wait here so no
    # caller ever holds one (under torch.compile the wait is already a node of the graph).
    if isinstance(out, funcol.AsyncCollectiveTensor):
        out = out.wait()
    return out


def init_tensor_parallel(backend: Optional[str] = None, device: Optional[str] = None) -> TensorParallel:
    """Join the default process group as launched by ``torchrun`` (env ``RANK``/``WORLD_SIZE``...).

    ``backend`` defaults to NCCL when ``device`` (default: CUDA if present) is CUDA, else gloo.
    On CUDA, each process takes the GPU ``LOCAL_RANK`` before the group is created, so NCCL
    binds every rank to its own device.
    """
    import torch.distributed as dist

    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing and not dist.is_initialized():
        raise RuntimeError(f"init_tensor_parallel: environment variables {missing} are not set; launch with "
                           f"torchrun --nproc-per-node N (or set them yourself)")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} must be 'cpu' or 'cuda'")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    backend = backend or ("nccl" if device == "cuda" else "gloo")
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    tp = TensorParallel.from_group()
    logger.info("tensor parallel: rank %d of %d, backend %s", tp.rank, tp.tp_size, dist.get_backend())
    return tp


def shutdown_tensor_parallel() -> None:
    """Leave the default process group, and free it while the interpreter is whole.

    A model's parallel layers hold the group inside reference cycles. Left to interpreter
    finalisation, gloo's worker threads were torn down there and aborted the process ("terminate
    called without an active exception") in about one run in twenty of the CPU demo, after every
    rank had finished its work; collecting the cycles right after the group is destroyed frees it
    in order (0 aborts in 100 runs).
    """
    import gc

    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def _record_dict(record) -> dict:
    if isinstance(record, dict):
        return dict(record)
    as_dict = getattr(record, "as_dict", None)
    if as_dict is None:
        raise ValueError(f"report entry {record!r} is neither a dict nor a FusionRecord")
    return as_dict()


def gather_reports(report: Sequence, group=None, dst: int = 0) -> Optional[list[list[dict]]]:
    """Collect every rank's fusion report (``KVFuseBackend.report``) on rank ``dst``.

    Returns, on ``dst``, one list of record dicts per rank (rank order); ``None`` elsewhere.
    Every rank of ``group`` must call it.
    """
    import torch.distributed as dist

    records = [_record_dict(r) for r in report]
    if not dist.is_initialized():
        return [records]
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    gathered = [None] * world if me == dst else None
    # gather_object takes dst as a global rank.
    global_dst = dist.get_global_rank(group, dst) if group is not None else dst
    dist.gather_object(records, gathered, dst=global_dst, group=group)
    return gathered


def compare_reports(per_rank: Sequence[Sequence[dict]]) -> list[str]:
    """Where the ranks' reports differ, one line per layer (empty: they agree record by record).

    Every rank compiles the same graph over its own heads, so every cache write must carry
    the same layer, mode and decision on every rank; a difference means some rank traced a
    different model or config.
    """
    problems = []
    if not per_rank:
        return ["no reports to compare"]
    base = [_record_dict(r) for r in per_rank[0]]
    for rank, report in enumerate(per_rank[1:], start=1):
        other = [_record_dict(r) for r in report]
        if len(other) != len(base):
            problems.append(f"rank {rank} reports {len(other)} cache writes, rank 0 reports {len(base)}")
        for i, (a, b) in enumerate(zip(base, other)):
            if a != b:
                diff = {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
                problems.append(f"cache write {i} ({a.get('layer_name')!r}): rank 0 vs rank {rank} differ in {diff}")
    return problems
