"""Shared pieces of the compile tests: tiny models from PagedAttention and a snapshotting backend."""

from __future__ import annotations

import torch
from torch import nn

import kvfuse
from kvfuse import AttentionMetadata, KVCacheConfig, PagedAttention, allocate_kv_cache
from kvfuse.backend import KVFuseBackend
from kvfuse.passes import KVFusePassManager
from kvfuse.passes.manager import graph_op_counts

HQ, HKV, D = 4, 2, 32
BLOCK = 8
NUM_BLOCKS = 12
SENTINEL = 0x5A  # a cache byte never produced by these inputs at unwritten slots


class TinyModel(nn.Module):
    """``n_layers`` attention layers with bf16 projections, each layer over its own cache."""

    def __init__(self, n_layers, config, sliding_windows=None, names=None, head_size=D, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        hidden = HQ * head_size
        self.head_size = head_size
        sliding_windows = sliding_windows or [None] * n_layers
        names = names or [f"model.layers.{i}.attn" for i in range(n_layers)]
        self.attn = nn.ModuleList(
            PagedAttention(HQ, HKV, head_size, names[i], config=config, sliding_window=sliding_windows[i])
            for i in range(n_layers)
        )
        qkv_out = (HQ + 2 * HKV) * head_size
        self.w_qkv = nn.ParameterList(
            nn.Parameter((torch.randn(hidden, qkv_out, generator=g) / hidden**0.5).bfloat16(), requires_grad=False)
            for _ in range(n_layers))

    def forward(self, x, caches, md):
        T = x.shape[0]
        hs = self.head_size
        for i, attn in enumerate(self.attn):
            qkv = torch.mm(x, self.w_qkv[i])
            q, k, v = qkv.split([HQ * hs, HKV * hs, HKV * hs], dim=-1)
            o = attn(q.reshape(T, HQ, hs), k.reshape(T, HKV, hs), v.reshape(T, HKV, hs), caches[i], md)
            x = x + o.reshape(T, HQ * hs)
        return x


def make_caches(model, device="cpu"):
    caches = []
    for attn in model.attn:
        c = allocate_kv_cache(attn.spec, NUM_BLOCKS, BLOCK, device=device)
        c.view(torch.uint8).fill_(SENTINEL)
        caches.append(c)
    return caches


def make_inputs(T=7, head_size=D, device="cpu", seed=1, context=3):
    """One sequence of ``context`` cached + ``T`` new tokens, one padding slot (-1) among the new."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, HQ * head_size, generator=g).bfloat16().to(device)
    total = context + T
    perm = torch.randperm(NUM_BLOCKS, generator=g)[: (total + BLOCK - 1) // BLOCK].to(torch.int32)
    positions = torch.arange(context, total)
    slots = perm[positions // BLOCK].long() * BLOCK + positions % BLOCK
    slots[T // 2] = -1
    md = AttentionMetadata(
        slot_mapping=slots.to(device),
        block_table=perm.unsqueeze(0).to(device),
        seq_lens=torch.tensor([total], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, T], dtype=torch.int32, device=device),
    )
    return x, md


class SnapshotManager(KVFusePassManager):
    """The real pass manager, plus op counts and source of each graph before and after."""

    def __init__(self, fuse=True, fuse_rotary=True):
        super().__init__(fuse=fuse, fuse_rotary=fuse_rotary)
        self.before, self.after, self.graphs_before, self.graphs_after = [], [], [], []

    def __call__(self, graph):
        self.before.append(graph_op_counts(graph))
        self.graphs_before.append(_copy(graph))
        super().__call__(graph)
        self.after.append(graph_op_counts(graph))
        self.graphs_after.append(_copy(graph))


def _copy(graph):
    """A copy of ``graph``: Inductor keeps mutating the original (reinplacing, decompositions)."""
    copy = torch.fx.Graph()
    out = copy.graph_copy(graph, {})
    copy.output(out)
    return copy


def snapshot_backend(fuse=True, fuse_rotary=True, **options) -> KVFuseBackend:
    """A kvfuse backend whose passes always run (caches off) and are observed."""
    be = kvfuse.make_backend(fuse=fuse, fuse_rotary=fuse_rotary, force_disable_caches=True, **options)
    be._manager = SnapshotManager(fuse=fuse, fuse_rotary=fuse_rotary)
    return be


def nodes_of(graph, op):
    """(node, schema-name -> arg) for every node running ``op``, functionalized or not."""
    out = []
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is op:
            names = [a.name for a in op._schema.arguments]
            out.append((n, {**dict(zip(names, n.args)), **n.kwargs}))
        elif getattr(n.target, "__name__", "").startswith("auto_functionalized") and n.args[0] is op:
            out.append((n, dict(n.kwargs)))
    return out


def assert_bytes_equal(a, b, what=""):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    ab, bb = a.view(torch.uint8), b.view(torch.uint8)
    diff = (ab != bb).nonzero()
    assert diff.numel() == 0, f"{what}: {diff.shape[0]} bytes differ, first at {diff[:4].tolist()}"
