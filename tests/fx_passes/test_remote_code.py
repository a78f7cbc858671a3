"""MLA attention written like DeepSeek's original remote code (modeling_deepseek.py of the
DeepSeek-V2 checkpoints): per-head K/V built by slice assignment, the expanded K/V handed to
``past_key_value.update(key_states, value_states, layer_idx, cache_kwargs)``, eager softmax.

With ``MLACache(static=True)`` under ``torch.compile(backend="mla_eager")`` the rewrite makes it
cache latents (L + R values per token) and decode reads them through ``mla_decode``; the outputs
equal the same module over ``DynamicCache`` run eagerly (which caches H x (P+R+V) values)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

transformers = pytest.importorskip("transformers")
from mla_compile.mla_ops.hf_cache import MLACache  # noqa: E402

HIDDEN, H, L, R, P, V = 48, 3, 32, 16, 16, 16


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class RemoteCodeMLA(torch.nn.Module):
    """The remote code's ``DeepseekV2Attention.forward`` (q_lora_rank None), trimmed to MLA."""

    def __init__(self, layer_idx: int = 0, softmax_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.layer_idx, self.softmax_dtype = layer_idx, softmax_dtype
        self.q_proj = torch.nn.Linear(HIDDEN, H * (P + R), bias=False)
        self.kv_a_proj_with_mqa = torch.nn.Linear(HIDDEN, L + R, bias=False)
        self.kv_a_layernorm = torch.nn.RMSNorm(L, eps=1e-6)
        self.kv_b_proj = torch.nn.Linear(L, H * (P + V), bias=False)
        self.o_proj = torch.nn.Linear(H * V, HIDDEN, bias=False)
        self.softmax_scale = (P + R) ** -0.5

    def forward(self, hidden_states, position_ids, attention_mask, past_key_value):
        bsz, q_len, _ = hidden_states.size()
        q = self.q_proj(hidden_states).view(bsz, q_len, H, P + R).transpose(1, 2)
        q_nope, q_pe = torch.split(q, [P, R], dim=-1)
        compressed_kv = self.kv_a_proj_with_mqa(hidden_states)
        compressed_kv, k_pe = torch.split(compressed_kv, [L, R], dim=-1)
        k_pe = k_pe.view(bsz, q_len, 1, R).transpose(1, 2)
        kv = (
            self.kv_b_proj(self.kv_a_layernorm(compressed_kv))
            .view(bsz, q_len, H, P + V)
            .transpose(1, 2)
        )
        k_nope, value_states = torch.split(kv, [P, V], dim=-1)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, R, 2, dtype=torch.float64) / R))
        freqs = position_ids[..., None].double() * inv_freq  # [B, S, R/2]
        emb = torch.cat((freqs, freqs), dim=-1).to(q.dtype)[:, None]  # [B, 1, S, R]
        cos, sin = emb.cos(), emb.sin()
        q_pe = q_pe * cos + rotate_half(q_pe) * sin
        k_pe = k_pe * cos + rotate_half(k_pe) * sin
        query_states = k_pe.new_empty(bsz, H, q_len, P + R)
        query_states[:, :, :, :P] = q_nope
        query_states[:, :, :, P:] = q_pe
        key_states = k_pe.new_empty(bsz, H, q_len, P + R)
        key_states[:, :, :, :P] = k_nope
        key_states[:, :, :, P:] = k_pe
        cache_kwargs = {"sin": sin, "cos": cos}
        key_states, value_states = past_key_value.update(
            key_states, value_states, self.layer_idx, cache_kwargs
        )
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.softmax_scale
        attn_weights = attn_weights + attention_mask[..., : key_states.shape[-2]]
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=self.softmax_dtype)
        attn_weights = attn_weights.to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, H * V)
        return self.o_proj(attn_output)


def additive_mask(pad: list[int], past: int, new: int, width: int) -> torch.Tensor:
    """``[B, 1, new, width]``: left padding hidden, causal over the ``past + new`` tokens."""
    key = torch.arange(width)[None, None, :]
    query = past + torch.arange(new)[None, :, None]
    hidden = (key > query) | (key < torch.tensor(pad)[:, None, None])
    return torch.zeros(len(pad), new, width, dtype=torch.float64).masked_fill(
        hidden, torch.finfo(torch.float64).min
    )[:, None]


def test_remote_code_attention_caches_latents() -> None:
    torch.manual_seed(0)
    layer = RemoteCodeMLA().double().eval()  # as written: softmax in float32
    truth = RemoteCodeMLA(softmax_dtype=torch.float64).double().eval()  # the float64 reference
    truth.load_state_dict(layer.state_dict())
    config = transformers.DeepseekV2Config(
        num_hidden_layers=1, num_attention_heads=H, kv_lora_rank=L, qk_rope_head_dim=R,
        qk_nope_head_dim=P, v_head_dim=V, hidden_size=HIDDEN,
    )  # fmt: skip
    pad, prompt, steps, capacity = [0, 2], 6, 4, 16
    static = MLACache(config, max_length=capacity, page_size=4, static=True)
    dynamic = transformers.DynamicCache()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer, backend="mla_eager", fullgraph=True)
    gen = torch.Generator().manual_seed(1)
    past = 0
    for new in [prompt] + [1] * steps:
        hidden = torch.randn(2, new, HIDDEN, generator=gen, dtype=torch.float64)
        positions = (past + torch.arange(new))[None].expand(2, -1) - torch.tensor(pad)[:, None]
        positions = positions.clamp_min(0)
        with torch.no_grad():
            want = truth(hidden, positions, additive_mask(pad, past, new, past + new), dynamic)
            got = compiled(hidden, positions, additive_mask(pad, past, new, capacity), static)
        for b in range(2):  # a left-padded sequence's pad rows are not compared: garbage
            real = slice(None) if new == 1 else slice(pad[b], None)
            error = (got[b, real] - want[b, real]).abs().max() / want[b, real].abs().max()
            # every step is absorbed (the 6-token prefill too: <= max_q_len), so float64
            # throughout, where the code as written would run its softmax in float32
            assert error <= 1e-10, (new, b, float(error))
        past += new
    # the prefill and the decode graph each turned the update into latent appends and their
    # attention into mla_decode over the pages
    assert counters["mla"]["latent_cache_updates"] == 2
    assert counters["mla"]["paged_sites"] == 2
    # per token: one latent row, against the H heads of keys (and values) the code hands over
    assert static.bytes_per_token() == (L + R) * 8
    keys, values = dynamic.layers[0].keys, dynamic.layers[0].values
    assert keys.shape[1] * (keys.shape[-1] + values.shape[-1]) == H * (P + R + V)
    assert int(static.get_seq_length()) == prompt + steps
