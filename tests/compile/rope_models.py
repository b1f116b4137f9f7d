"""Tiny models whose rotary embeddings are written as transformers and kvfuse's demo write them.

The rotations are copies of the *form* of transformers' code (``rotate_half`` +
``apply_rotary_pos_emb`` of models/llama; the interleaved ``rotate_half`` of models/cohere; the
partial-rotary split of models/gpt_neox), in the layout transformers uses ([B, H, S, D] with
``cos.unsqueeze(1)``), or :func:`kvfuse.models.llama.apply_rotary` of the demo model ([T, H, D],
float32). cos/sin are computed inside the graph from positions, as a rotary-embedding module does.
"""

from __future__ import annotations

import torch
from torch import nn

from kvfuse import PagedAttention
from kvfuse.models.llama import apply_rotary

HQ, HKV = 4, 2
STYLES = ("hf_neox", "hf_gptj", "hf_partial", "demo", "hf_neox_f32", "hf_neox_cached", "none")


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def rotate_half_interleaved(x):
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    return torch.stack([-x2, x1], dim=-1).flatten(-2)


def apply_rotary_interleaved(q, k, cos, sin, unsqueeze_dim=1):
    dtype = q.dtype
    q, k = q.float(), k.float()
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half_interleaved(q) * sin)
    k_embed = (k * cos) + (rotate_half_interleaved(k) * sin)
    return q_embed.to(dtype=dtype), k_embed.to(dtype=dtype)


def apply_partial(q, k, cos, sin, rotary_dim):
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed, k_embed = apply_rotary_pos_emb(q_rot, k_rot, cos, sin)
    return torch.cat([q_embed, q_pass], dim=-1), torch.cat([k_embed, k_pass], dim=-1)


class RopeModel(nn.Module):
    """One PagedAttention layer per entry of ``styles`` (see :data:`STYLES`), each over its own cache.

    ``configs`` gives each layer's KVCacheConfig (a skip layer beside FP8 and NVFP4 layers...).
    """

    def __init__(self, styles, configs, head_size=32, rotary_dim=None, seed=0, theta=10000.0, chain=True):
        super().__init__()
        # chain=False: every layer reads the model's input (their outputs are summed), so that each
        # layer's cache depends on its own rotation and write only, not on earlier layers' attention.
        self.chain = chain
        g = torch.Generator().manual_seed(seed)
        self.styles = tuple(styles)
        self.head_size = head_size
        self.rotary_dim = rotary_dim or head_size // 2
        hidden = HQ * head_size
        self.attn = nn.ModuleList(
            PagedAttention(HQ, HKV, head_size, f"model.layers.{i}.self_attn.attn", config=configs[i], layer_index=i)
            for i in range(len(styles)))
        qkv_out = (HQ + 2 * HKV) * head_size
        self.w_qkv = nn.ParameterList(
            nn.Parameter((torch.randn(hidden, qkv_out, generator=g) / hidden**0.5).bfloat16(), requires_grad=False)
            for _ in styles)
        inv = lambda dim: 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))  # noqa: E731
        self.register_buffer("inv_freq", inv(head_size), persistent=False)
        self.register_buffer("inv_freq_partial", inv(self.rotary_dim), persistent=False)
        # hf_neox_cached: an engine's precomputed tables, rows gathered by position. Their halves
        # are equal too, but nothing in the graph shows it, so the pass must read them whole.
        freqs = torch.arange(4096, dtype=torch.float32)[:, None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos().bfloat16(), persistent=False)
        self.register_buffer("sin_cached", emb.sin().bfloat16(), persistent=False)

    def _hf_cos_sin(self, positions, inv_freq, dtype, interleaved=False):
        freqs = positions[None, :, None].float() * inv_freq  # [1, T, D/2]
        emb = torch.repeat_interleave(freqs, 2, dim=-1) if interleaved else torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, x, caches, md, positions):
        T = x.shape[0]
        hs = self.head_size
        hidden = x
        for i, (style, attn) in enumerate(zip(self.styles, self.attn)):
            layer_in = hidden if self.chain else x
            q, k, v = torch.mm(layer_in, self.w_qkv[i]).split([HQ * hs, HKV * hs, HKV * hs], dim=-1)
            if style == "demo":
                q = apply_rotary(q.reshape(T, HQ, hs), positions, self.inv_freq)
                k = apply_rotary(k.reshape(T, HKV, hs), positions, self.inv_freq)
            elif style == "none":
                q, k = q.reshape(T, HQ, hs), k.reshape(T, HKV, hs)
            else:
                # transformers' layout: [B, H, S, D], cos/sin [B, S, D] unsqueezed at dim 1
                qh = q.view(1, T, HQ, hs).transpose(1, 2)
                kh = k.view(1, T, HKV, hs).transpose(1, 2)
                if style == "hf_neox":
                    cos, sin = self._hf_cos_sin(positions, self.inv_freq, x.dtype)
                    qh, kh = apply_rotary_pos_emb(qh, kh, cos, sin)
                elif style == "hf_neox_cached":
                    cos, sin = self.cos_cached[positions][None], self.sin_cached[positions][None]
                    qh, kh = apply_rotary_pos_emb(qh, kh, cos, sin)
                elif style == "hf_neox_f32":  # float32 tables: the products are promoted to float32
                    cos, sin = self._hf_cos_sin(positions, self.inv_freq, torch.float32)
                    qh, kh = apply_rotary_pos_emb(qh, kh, cos, sin)
                    qh, kh = qh.to(x.dtype), kh.to(x.dtype)
                elif style == "hf_gptj":
                    cos, sin = self._hf_cos_sin(positions, self.inv_freq, torch.float32, interleaved=True)
                    qh, kh = apply_rotary_interleaved(qh, kh, cos, sin)
                elif style == "hf_partial":
                    cos, sin = self._hf_cos_sin(positions, self.inv_freq_partial, x.dtype)
                    qh, kh = apply_partial(qh, kh, cos, sin, self.rotary_dim)
                else:
                    raise ValueError(f"style={style!r} is not one of {STYLES}")
                q = qh.transpose(1, 2).reshape(T, HQ, hs)
                k = kh.transpose(1, 2).reshape(T, HKV, hs)
            o = attn(q, k, v.reshape(T, HKV, hs), caches[i], md)
            hidden = hidden + o.reshape(T, HQ * hs)
        return hidden
