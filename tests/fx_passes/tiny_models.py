"""Tiny random Hugging Face MLA models of every tested family (no download, < 1 s to build)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import os

import pytest
import torch
from torch._dynamo.utils import counters

transformers = pytest.importorskip("transformers")

from mla_compile.mla_ops.hf_cache import LATENT_ATTENTION, SPARSE_LATENT_ATTENTION  # noqa: E402

# DeepSeek Sparse Attention's layer type: "indexed_attention" from transformers 5.18, before that
# "deepseek_sparse_attention" (which 5.18 and later still read as the former).
INDEXED_LAYER = (
    "indexed_attention"
    if "indexed_attention" in getattr(transformers.configuration_utils, "ALLOWED_LAYER_TYPES", ())
    else "deepseek_sparse_attention"
)

# Shared MLA shapes: H=4 heads (one family uses 3: odd head counts), L=32, R=16, P=16, V=16.
MLA = dict(
    vocab_size=128,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
)
MOE = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
YARN = {"rope_type": "yarn", "factor": 4.0, "mscale_all_dim": 1.0, "mscale": 1.0,
        "original_max_position_embeddings": 64, "rope_theta": 10000.0, "beta_fast": 32.0,
        "beta_slow": 1.0}  # fmt: skip
MAX_POSITIONS = 256  # = YARN factor x original_max_position_embeddings


def _config(family: str, q_lora_rank: int | None, yarn: bool):
    rope = {"rope_parameters": YARN} if yarn else {}
    rope["max_position_embeddings"] = MAX_POSITIONS
    if family == "deepseek_v2":
        return transformers.DeepseekV2Config(
            **MLA, **MOE, **rope, intermediate_size=128, num_hidden_layers=2,
            first_k_dense_replace=1, n_group=2, topk_group=1, q_lora_rank=q_lora_rank,
        )  # fmt: skip
    if family == "deepseek_v3":
        return transformers.DeepseekV3Config(
            **MLA, **MOE, **rope, intermediate_size=128, num_hidden_layers=2,
            first_k_dense_replace=1, n_group=2, topk_group=1, q_lora_rank=q_lora_rank,
        )  # fmt: skip
    if family == "minicpm3":
        return transformers.MiniCPM3Config(
            **{**MLA, "num_attention_heads": 3, "num_key_value_heads": 3, "hidden_size": 48},
            **rope,
            intermediate_size=128, num_hidden_layers=2, q_lora_rank=q_lora_rank,
        )  # fmt: skip
    if family == "glm4_moe_lite":
        return transformers.Glm4MoeLiteConfig(
            **MLA, **MOE, **rope, intermediate_size=128, num_hidden_layers=2, n_group=1,
            topk_group=1, q_lora_rank=q_lora_rank,
        )  # fmt: skip
    if family == "longcat_flash":
        return transformers.LongcatFlashConfig(
            **MLA, **rope, head_dim=16, num_layers=1, ffn_hidden_size=128,
            expert_ffn_hidden_size=32, n_routed_experts=4, zero_expert_num=2, moe_topk=2,
            q_lora_rank=q_lora_rank,
        )  # fmt: skip
    if family == "mistral4":
        if yarn:  # Mistral 4 also scales the query by position (Llama 4 style)
            rope = {**rope, "rope_parameters": {**YARN, "llama_4_scaling_beta": 0.1}}
        return transformers.Mistral4Config(
            **MLA, **MOE, **rope, intermediate_size=128, num_hidden_layers=2, n_group=1,
            topk_group=1, q_lora_rank=q_lora_rank, pad_token_id=0,
        )  # fmt: skip
    if family == "kimi_linear":
        return transformers.KimiLinearConfig(
            **MLA, **MOE, intermediate_size=128, num_hidden_layers=2, num_local_experts=8,
            q_lora_rank=q_lora_rank, layer_types=["full_attention", "full_attention"],
            pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
    if family == "bailing_hybrid":  # one linear-attention layer, then one MLA layer
        return transformers.BailingHybridConfig(
            **MLA, **MOE, **rope, intermediate_size=128, num_hidden_layers=2, head_dim=16,
            layer_types=["linear_attention", "full_attention"], num_local_experts=8, n_group=2,
            topk_group=1, first_k_dense_replace=1, q_lora_rank=q_lora_rank, pad_token_id=0,
            bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
    if family == "dots3_note":  # per-layer MLA shapes: its sliding-window layers have 3 heads
        return transformers.Dots3NoteTextConfig(
            **MLA, **MOE, **rope, head_dim=32, q_lora_rank=q_lora_rank, intermediate_size=128,
            num_hidden_layers=3, layer_types=["indexed_attention", "sliding_attention",
            "indexed_attention"], sliding_window=5, index_topk=SPARSE_TOP_K, index_head_dim=16,
            index_n_heads=2, n_group=2, topk_group=1, shared_experts_intermediate_size=32,
            swa_num_attention_heads=3, swa_num_key_value_heads=3, swa_q_lora_rank=20,
            swa_kv_lora_rank=24, swa_head_dim=32, swa_qk_nope_head_dim=16, swa_v_head_dim=8,
            pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
    if family == "mistral_large4":  # a VLM run on text: KV sharing, NoPE layers, sparse attention
        text = dict(
            **MLA, **MOE, **rope, intermediate_size=128, num_hidden_layers=4,
            no_rope_layers=[1, 1, 0, 0], kv_source_layers=[0, 0, 2, 2],
            indexer_types=["full", "shared", "full", "shared"], index_topk=SPARSE_TOP_K,
            index_head_dim=16, index_n_heads=2, pad_token_id=0,
        )  # fmt: skip
        vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=2, patch_size=4, image_size=16,
                      head_dim=16)  # fmt: skip
        return transformers.MistralLarge4Config(text_config=text, vision_config=vision)
    if family == "glm5_next":  # a VLM run on text: linear-attention layers, MLA without RoPE
        text = dict(
            **{**MLA, "qk_rope_head_dim": 0}, **MOE, **rope, intermediate_size=128,
            num_hidden_layers=2, q_lora_rank=q_lora_rank,
            layer_types=["linear_attention", INDEXED_LAYER], index_topk=SPARSE_TOP_K,
            index_head_dim=16, index_n_heads=2, index_kpool=2, linear_head_dim=16,
            linear_num_heads=2, hc_mult=2, hc_sinkhorn_iters=3, pad_token_id=0,
        )  # fmt: skip
        vision = dict(depth=1, hidden_size=32, num_heads=2, out_hidden_size=64,
                      intermediate_size=64, projection_intermediate_size=64)  # fmt: skip
        return transformers.Glm5NextConfig(text_config=text, vision_config=vision)
    if family == "hy_v4_vl":  # hy_v4's text model inside a VLM
        # multimodal RoPE: (time, height, width) sections of the 8 rotary frequencies
        rope_parameters = {
            **rope.get("rope_parameters", {"rope_type": "default", "rope_theta": 1e4})
        }
        rope = {**rope, "rope_parameters": {**rope_parameters, "mrope_section": [4, 2, 2]}}
        text = _deepseek_like(transformers.HYV4VLTextConfig, q_lora_rank, rope)
        vision = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2,
                      num_hidden_layers=1, out_hidden_size=64, patch_size=4)  # fmt: skip
        return transformers.HYV4VLConfig(text_config=text, vision_config=vision)
    if family in DEEPSEEK_LIKE:
        config_class = {**CONFIG_CLASSES, **EAGER_ONLY}[family]
        return _deepseek_like(getattr(transformers, config_class), q_lora_rank, rope)
    raise ValueError(f"unknown family {family!r}")


# Families whose configs take DeepSeek-V3's argument names; each is given those its config
# declares. The DeepSeek Sparse Attention families (SPARSE_ATTENTION) keep 4 keys per query
# (``index_topk``), so their indexer's mask hides keys in every test that has more.
DEEPSEEK_LIKE = ("axk1", "axk2", "deepseek_v32", "glm_moe_dsa", "sarvam_mla", "youtu", "hy_v4")
SPARSE_ATTENTION = (
    "axk2",
    "deepseek_v32",
    "glm_moe_dsa",
    "dots3_note",
    "mistral_large4",
    "glm5_next",
)
# Families with layers whose state MLACache does not keep: it refuses them by name (sliding-window
# or linear-attention layers, an indexer over pooled keys, layers sharing latents).
NOT_FOR_MLA_CACHE = ("bailing_hybrid", "dots3_note", "mistral_large4", "glm5_next")
SPARSE_TOP_K = 4


def _deepseek_like(config_class, q_lora_rank: int | None, rope: dict):
    wanted = dict(
        **MLA, **MOE, **rope, intermediate_size=128, num_hidden_layers=2, first_k_dense_replace=1,
        n_group=2, topk_group=1, q_lora_rank=q_lora_rank, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, index_topk=SPARSE_TOP_K, index_head_dim=16, index_n_heads=2,
    )  # fmt: skip
    if dataclasses.is_dataclass(config_class):
        fields = {f.name for f in dataclasses.fields(config_class)}
    else:  # configs before transformers' dataclass ones
        fields = set(inspect.signature(config_class.__init__).parameters)
    return config_class(**{k: v for k, v in wanted.items() if k in fields})


CONFIG_CLASSES = {
    "deepseek_v2": "DeepseekV2Config",
    "deepseek_v3": "DeepseekV3Config",
    "minicpm3": "MiniCPM3Config",
    "glm4_moe_lite": "Glm4MoeLiteConfig",
    "longcat_flash": "LongcatFlashConfig",
    "mistral4": "Mistral4Config",
    "kimi_linear": "KimiLinearConfig",  # no RoPE on its MLA layers
    "axk1": "AXK1Config",
    "axk2": "AXK2Config",  # DeepSeek Sparse Attention (an indexer's top-k as a mask)
    "deepseek_v32": "DeepseekV32Config",  # DeepSeek Sparse Attention
    "glm_moe_dsa": "GlmMoeDsaConfig",  # DeepSeek Sparse Attention
    "sarvam_mla": "SarvamMLAConfig",  # runs as DeepseekV3ForCausalLM
    "youtu": "YoutuConfig",  # dense MLP
    "bailing_hybrid": "BailingHybridConfig",  # linear-attention layers between the MLA ones
    # Sparse attention, sliding-window layers, per-layer MLA shapes, a sigmoid gate per head
    "dots3_note": "Dots3NoteTextConfig",
    # Sparse attention, layers that reuse an earlier layer's latents, NoPE layers (R = 0), a
    # per-head query scale by log position; a VLM (MistralLarge4ForConditionalGeneration)
    "mistral_large4": "MistralLarge4Config",
    # Sparse attention over pooled keys, linear-attention layers, MLA without RoPE,
    # hyper-connections; a VLM (Glm5NextForConditionalGeneration)
    "glm5_next": "Glm5NextConfig",
}
# Families with eager attention only, tested on their own: hy_v4 and its VLM hy_v4_vl (a learned
# sink logit per head in the softmax; sparse attention too).
EAGER_ONLY = {"hy_v4": "HYV4Config", "hy_v4_vl": "HYV4VLConfig"}
# Families whose text model is not ``<Config name>ForCausalLM`` nor AutoModelForCausalLM's.
MODEL_CLASSES = {
    "mistral_large4": "MistralLarge4ForConditionalGeneration",
    "glm5_next": "Glm5NextForConditionalGeneration",
    "hy_v4_vl": "HYV4VLForConditionalGeneration",
}
# The tested families this transformers release has (kimi_linear arrived after 5.14), or those
# of them that MLA_TEST_FAMILIES lists (comma-separated): the Makefile's run pinned to 5.17 takes
# one family of each attention code path, the full set running under the newest release.
FAMILIES = [f for f, config in CONFIG_CLASSES.items() if hasattr(transformers, config)]
if os.environ.get("MLA_TEST_FAMILIES"):
    FAMILIES = [f for f in FAMILIES if f in os.environ["MLA_TEST_FAMILIES"].split(",")]


@functools.cache
def latent_attention(family: str) -> bool:
    """Whether this release's attention of ``family`` hands the cache latents (not expanded
    per-head K/V): transformers >= 5.15, and >= 5.18 for the DeepSeek Sparse Attention families
    (their configs have an ``index_topk``; ``mla_ops.hf_cache.MIN_TRANSFORMERS_SPARSE``)."""
    text = _config(family, 24, False).get_text_config()
    sparse = getattr(text, "index_topk", None) is not None
    return SPARSE_LATENT_ATTENTION if sparse else LATENT_ATTENTION


def skip_unless_latent_attention(family: str) -> None:
    """Skip a test of the latent-caching attention where this release's ``family`` caches
    expanded K/V instead (the sparse-attention families before transformers 5.18)."""
    if not latent_attention(family):
        pytest.skip(
            f"transformers {transformers.__version__} caches {family}'s expanded K/V (its "
            "sparse attention caches latents from 5.18)"
        )


# LongCat-Flash's MoE loops over the experts hit (data-dependent, its own code ignores
# experts_implementation): the original model does not compile with fullgraph=True.
FULLGRAPH = {family: family != "longcat_flash" for family in CONFIG_CLASSES}


def tiny_model(
    family: str,
    *,
    attn: str = "sdpa",
    q_lora_rank: int | None = 24,
    yarn: bool = False,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
):
    """A tiny random ``*ForCausalLM`` of ``family`` in eval mode, built as transformers builds
    by default; in float64 with ``experts_implementation="batched_mm"`` (the same products), since
    these tests also run the original uncompiled and torch's grouped product, the default's
    eager path, takes no float64 on CPU (``test_default_build.py`` runs the default build in
    float64 where it can run: compiled)."""
    config = _config(family, q_lora_rank, yarn)
    torch.manual_seed(seed)
    kwargs = dict(dtype=dtype, attn_implementation=attn)
    if dtype == torch.float64:
        kwargs["experts_implementation"] = "batched_mm"
    class_name = type(config).__name__.replace("Config", "ForCausalLM")
    model_class = getattr(transformers, MODEL_CLASSES.get(family, class_name), None)
    if model_class is not None:  # mistral4 has no AutoModelForCausalLM entry
        return model_class._from_config(config, **kwargs).eval()
    # sarvam_mla runs as DeepseekV3ForCausalLM
    return transformers.AutoModelForCausalLM.from_config(config, **kwargs).eval()


def left_padded_batch(lengths: tuple[int, ...], seed: int = 0, vocab: int = 128):
    """``input_ids [B, max_len]`` and ``attention_mask`` with left padding (pad id 0)."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, width - n :] = torch.randint(3, vocab, (n,), generator=gen)
        mask[b, width - n :] = 1
    return ids, mask


def rewritten(model, backend: str = "mla_eager"):
    """The model with its forward compiled by ``backend``; fullgraph wherever the original
    compiles so (the rewrite adds no graph break)."""
    torch._dynamo.reset()
    counters.clear()
    fullgraph = FULLGRAPH.get(model.config.model_type, True)
    model.forward = torch.compile(model.forward, backend=backend, fullgraph=fullgraph)
    return model


def truth_model(model):
    """The same weights with SDPA attention: the float64 reference."""
    config = copy.deepcopy(model.config)
    exact = type(model)._from_config(
        config, dtype=torch.float64, attn_implementation="sdpa", experts_implementation="batched_mm"
    )
    exact.load_state_dict(model.state_dict())
    return exact.eval()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def generate_with_logits(model, cache, ids, mask, new_tokens: int):
    """Greedy ``generate()`` of ``new_tokens`` over ``cache`` (None: the model's default):
    ``(sequences, logits [new_tokens, B, vocab])``."""
    from mla_compile.mla_ops.hf_cache import cache_kwargs

    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
            output_logits=True, return_dict_in_generate=True, **cache_kwargs(model, cache),
        )  # fmt: skip
    return out.sequences, torch.stack(out.logits)


def _whole_cache_gathered(*args, **kwargs):
    raise AssertionError("mla::cp_rows ran: a site read the gathered cache, not its pages")


@contextlib.contextmanager
def no_whole_cache_gather():
    """While open, the whole-cache gather of a context-parallel cache (``mla::cp_rows``'s
    ``dist.all_gather``) raises: every rewritten site must read its rank's pages. The states'
    merge is a functional collective, and ``cache_kwargs``'s check an ``all_gather_object``:
    neither goes through ``dist.all_gather``."""
    import torch.distributed as dist

    gather, dist.all_gather = dist.all_gather, _whole_cache_gathered
    try:
        yield
    finally:
        dist.all_gather = gather


def attention_layers(model) -> int:
    return sum(1 for name, _ in model.named_modules() if name.endswith("kv_b_proj"))


def llama_model(dtype: torch.dtype = torch.float64):
    """A tiny random Llama (no MLA): the negative control."""
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(dtype).eval()
