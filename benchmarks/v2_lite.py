"""DeepSeek-V2-Lite's shapes with random weights (the benchmarks' model; no download)."""

from __future__ import annotations

import torch
import transformers

# hidden 2048, 16 heads, kv_lora_rank 512, qk_rope 64, qk_nope 128, v_head 128, q_lora_rank None,
# MoE: 64 routed experts (6 per token) + 2 shared, the first layer dense.
V2_LITE = dict(
    vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
    num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2,
    num_experts_per_tok=6, first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=512,
    q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    max_position_embeddings=65536,
)  # fmt: skip


def v2_lite(layers: int, device: str = "cuda", dtype: torch.dtype = torch.bfloat16):
    """A ``DeepseekV2ForCausalLM`` with V2-Lite's shapes and ``layers`` layers, eval mode."""
    config = transformers.DeepseekV2Config(**V2_LITE, num_hidden_layers=layers)
    torch.manual_seed(0)
    with torch.device(device):
        # grouped_mm: the experts as one grouped GEMM (no per-expert Python loop), for every variant
        model = transformers.DeepseekV2ForCausalLM._from_config(
            config, dtype=dtype, attn_implementation="sdpa", experts_implementation="grouped_mm"
        )
    return model.eval()
