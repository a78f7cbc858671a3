"""The rewritten model over MLACache(static=True): decode reads the pages in place through
mla_decode (block table, device lengths), compiles once, and generates the original's tokens.

Every test runs on any transformers release: >= 5.15 hands the cache latents; < 5.15 hands it
expanded K/V, which the rewrite turns into latent appends (fx_passes/latent_cache.py), so the
same tests are the pinned-release CI run's proof that the rewritten model caches latents. The
sparse-attention families hand it latents only from 5.18, and MLACache refuses them before."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch._dynamo.utils import counters

from mla_compile import fx_passes
from tests.fx_passes.tiny_models import (
    FAMILIES,
    FULLGRAPH,
    NOT_FOR_MLA_CACHE,
    SPARSE_ATTENTION,
    attention_layers,
    latent_attention,
    left_padded_batch,
    rewritten,
    tiny_model,
    truth_model,
)

hf_cache = pytest.importorskip("mla_compile.mla_ops.hf_cache")
transformers = pytest.importorskip("transformers")


def latent_cache(model, page_size: int = 4, max_length: int = 64):
    return hf_cache.MLACache(model.config, max_length=max_length, page_size=page_size, static=True)


# Sparse-attention families keep their indexer's keys beside the latents (transformers >= 5.18);
# the families in NOT_FOR_MLA_CACHE, and the sparse ones before 5.18, are refused (below).
CASES = [
    (family, "sdpa")
    for family in FAMILIES
    if family not in NOT_FOR_MLA_CACHE
    and (family not in SPARSE_ATTENTION or latent_attention(family))
]
CASES += [("deepseek_v3", "eager")]


def indexed_layers(model) -> int:
    """Layers that run a sparse-attention indexer of their own (and so cache its keys)."""
    return sum(1 for name, module in model.named_modules() if name.endswith("self_attn.indexer"))


@pytest.mark.parametrize(("family", "attn"), CASES)
def test_greedy_generate_reads_pages_in_place(family: str, attn: str) -> None:
    """Float64, a left-padded batch, 32 new tokens: the original's tokens (default cache, SDPA
    truth), every decode site rewritten to the paged read, one prefill and one decode graph.
    Eager attention: prompts <= 8 tokens, so the prefill is rewritten too (as in
    test_hf_models.py: the eager float64 prefill would write NaN at pad positions)."""
    model = tiny_model(family, attn=attn, yarn=family != "kimi_linear")
    exact = truth_model(model)
    ids, mask = left_padded_batch((5, 11) if attn == "sdpa" else (3, 8), seed=4)
    args = dict(attention_mask=mask, max_new_tokens=32, do_sample=False, pad_token_id=0)
    want = exact.generate(ids, **args, return_dict_in_generate=True)
    want_tokens = want.sequences
    cache = latent_cache(model)
    if family in SPARSE_ATTENTION:
        # The indexer scores keys in float32, so which of two near-equal keys its top-k keeps
        # depends on the length of the key tensor (its matmul's blocking): a static cache's
        # capacity-long keys pick differently from the default cache's. The truth is then
        # transformers' own static cache of MLACache's capacity.
        static = transformers.StaticCache(config=exact.config, max_cache_len=cache.store.capacity)
        want_tokens = exact.generate(ids, **args, **hf_cache.cache_kwargs(exact, static))
    got = rewritten(model).generate(ids, **args, **hf_cache.cache_kwargs(model, cache))
    assert torch.equal(got, want_tokens)
    layers = attention_layers(model)
    rewritten_graphs = 1 if attn == "sdpa" else 2  # eager: the short prefill is rewritten too
    assert counters["mla"]["paged_sites"] == rewritten_graphs * layers, dict(counters["mla"])
    assert counters["mla"]["absorbed_sites"] == rewritten_graphs * layers
    if not latent_attention(family):
        # prefill and decode graph each turned every update into latents
        assert counters["mla"]["latent_cache_updates"] == 2 * layers

    # What a token costs: one latent row per layer (and a sparse-attention model's indexer key
    # per indexed layer), against the default cache's rows.
    config = model.config
    latent_row = (config.kv_lora_rank + config.qk_rope_head_dim) * 8  # float64
    index_row = indexed_layers(model) * getattr(config, "index_head_dim", 0) * 8
    assert cache.bytes_per_token() == layers * latent_row + index_row
    assert cache.paged.pools[0].nbytes == cache.paged.num_pages * cache.paged.page_size * latent_row
    default = hf_cache.output_cache(want)
    tokens = got.shape[0] * default.get_seq_length()
    default_bytes = 0
    for layer in default.layers:  # an indexer key cache where the layer has one of its own
        indexer_keys = getattr(layer, "indexer_keys", None)
        default_bytes += layer.keys.nbytes + layer.values.nbytes
        default_bytes += indexer_keys.nbytes if indexer_keys is not None else 0
    expanded_row = (
        config.num_attention_heads
        * (config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim)
        * 8
    )
    assert default_bytes / tokens == index_row + layers * (
        latent_row if latent_attention(family) else expanded_row
    )
    if FULLGRAPH[family]:
        # prefill + one decode graph for all 23 decode steps: the lengths live on the device
        assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])


def test_decode_graph_has_no_gather_and_no_expansion() -> None:
    """In the rewritten decode graph the pages go straight to mla_decode: no paged_rows gather,
    no kv_b_proj over the cached tokens."""
    model = tiny_model("deepseek_v3")
    ids, mask = left_padded_batch((3, 6), seed=5)
    graphs = []

    def keep(gm, example_inputs):
        report = fx_passes.absorb_mla(gm)
        graphs.append((gm, report))
        return gm

    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend=keep, fullgraph=True)
    model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0,
                   **hf_cache.cache_kwargs(model, latent_cache(model)))  # fmt: skip
    decode_gm, report = graphs[-1]
    assert report.rewritten == attention_layers(model)
    assert all(s.reason.endswith("cache=paged") for s in report.sites if s.status == "rewritten")
    targets = [str(n.target) for n in decode_gm.graph.nodes]
    assert not any("paged_rows" in t for t in targets)
    weight_users = [
        n for n in decode_gm.graph.nodes if n.op == "placeholder" and "kv_b_proj" in n.name
    ]
    for weight in weight_users:  # read only as W_UK / W_UV views by the replacement
        users = [str(u.target) for u in weight.users]
        assert all("absorbed_mla_attention_paged" in u for u in users), users


def test_sampling_and_beam_search() -> None:
    model = tiny_model("deepseek_v2", q_lora_rank=None)
    exact = truth_model(model)
    ids, mask = left_padded_batch((4, 9), seed=6)
    common = dict(attention_mask=mask, max_new_tokens=10, pad_token_id=0)
    torch.manual_seed(7)
    want_sampled = exact.generate(ids, **common, do_sample=True, top_k=20)
    want_beams = exact.generate(ids, **common, do_sample=False, num_beams=3)
    model = rewritten(model)
    torch.manual_seed(7)
    sampled = model.generate(ids, **common, do_sample=True, top_k=20,
                             **hf_cache.cache_kwargs(model, latent_cache(model)))  # fmt: skip
    beams = model.generate(ids, **common, do_sample=False, num_beams=3,
                           **hf_cache.cache_kwargs(model, latent_cache(model)))  # fmt: skip
    assert torch.equal(sampled, want_sampled)
    assert torch.equal(beams, want_beams)


def test_inductor_backend_over_latent_cache() -> None:
    """backend="mla" (rewrite + Inductor, CPU here) over the paged cache, float32."""
    model = tiny_model("deepseek_v3", dtype=torch.float32)
    ids, mask = left_padded_batch((5, 10), seed=8)
    args = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    want = model.generate(ids, **args)
    got = rewritten(model, backend="mla").generate(
        ids, **args, **hf_cache.cache_kwargs(model, latent_cache(model))
    )
    assert counters["mla"]["paged_sites"] == attention_layers(model)
    assert torch.equal(got, want)


def test_growing_cache_refuses_compile() -> None:
    model = rewritten(tiny_model("deepseek_v3"))
    ids, mask = left_padded_batch((3, 4), seed=9)
    cache = hf_cache.MLACache(model.config, max_length=32, page_size=4, static=False)
    with pytest.raises(Exception, match=r"static=True"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0,
                       **hf_cache.cache_kwargs(model, cache))  # fmt: skip


REFUSALS = {
    "dots3_note": r"also has sliding_attention layers",
    "mistral_large4": r"index_topk=4\): some layers read another layer's latents",
    "glm5_next": r"also has linear_attention layers",
}


@pytest.mark.parametrize("family", [f for f in REFUSALS if f in FAMILIES])
def test_models_whose_state_mla_cache_cannot_keep_are_refused_by_name(family: str) -> None:
    """Sliding-window layers, linear-attention layers, layers that share another layer's latents:
    MLACache says so at construction, naming the default cache, instead of failing inside the
    compiled step."""
    with pytest.raises(NotImplementedError, match=REFUSALS[family] + r".*default cache"):
        latent_cache(tiny_model(family))


@pytest.mark.skipif(
    hf_cache.SPARSE_LATENT_ATTENTION, reason="transformers >= 5.18 keeps the indexer's keys"
)
@pytest.mark.parametrize(
    "family", [f for f in SPARSE_ATTENTION if f in FAMILIES and f not in NOT_FOR_MLA_CACHE]
)
def test_sparse_attention_before_latent_attention_is_refused(family: str) -> None:
    """Before 5.18 a sparse-attention model's indexer runs around expanded K/V (the other MLA
    families cache latents from 5.15), which MLACache turns into latents only under the rewrite
    and without the indexer's keys: it refuses sparse-attention models there, naming 5.18."""
    with pytest.raises(NotImplementedError, match=r"index_topk=4.*>= 5\.18.*default cache"):
        latent_cache(tiny_model(family))


@pytest.mark.skipif(
    not hf_cache.SPARSE_LATENT_ATTENTION,
    reason="latent caching of sparse-attention models needs transformers >= 5.18",
)
def test_sparse_attention_keys_follow_the_batch() -> None:
    """The indexer's keys sit in pools of their own beside the latents, on the same pages: beam
    search and a batch regroup move them with the latents (deepseek_v32, unrewritten, growing
    cache: the original's tokens)."""
    model = tiny_model("deepseek_v32")
    ids, mask = left_padded_batch((4, 9), seed=12)
    common = dict(attention_mask=mask, max_new_tokens=10, pad_token_id=0)
    want = model.generate(ids, **common, do_sample=False, num_beams=3, num_return_sequences=2)
    cache = hf_cache.MLACache(model.config, max_length=64, page_size=4)
    got = model.generate(ids, **common, do_sample=False, num_beams=3, num_return_sequences=2,
                         **hf_cache.cache_kwargs(model, cache))  # fmt: skip
    assert torch.equal(got, want)
    assert sum(p is not None for p in cache.paged.index_pools) == indexed_layers(model)


@pytest.mark.skipif(
    "kimi_linear" not in FAMILIES, reason="kimi_linear came after transformers 5.14"
)
def test_hybrid_linear_attention_models_are_refused_by_name() -> None:
    """Kimi Linear's default layer_types mix linear-attention layers (recurrent states) with MLA:
    MLACache keeps latents only and says so, instead of transformers' "Cannot get conv state"."""
    config = tiny_model("kimi_linear").config
    config.layer_types = ["linear_attention", "full_attention"]
    with pytest.raises(
        NotImplementedError, match=r"also has linear_attention layers.*default cache"
    ):
        hf_cache.MLACache(config, max_length=16)


def test_layers_of_different_latent_widths_are_refused_by_name() -> None:
    """A heterogeneous config (transformers' ``per_layer_config``, as Dots 3 Note's sliding-window
    layers) may give layers different latent widths; MLACache's one pool cannot hold them."""

    class HeterogeneousConfig:  # the attributes MLACache reads
        num_hidden_layers = 2
        per_layer_config = (
            SimpleNamespace(kv_lora_rank=32, qk_rope_head_dim=16),
            SimpleNamespace(kv_lora_rank=24, qk_rope_head_dim=16),
        )

        def get_text_config(self):
            return self

    with pytest.raises(
        NotImplementedError, match=r"one latent width.*\(24, 16\), \(32, 16\).*default cache"
    ):
        hf_cache.MLACache(HeterogeneousConfig(), max_length=16)


@pytest.mark.parametrize("up_front", [False, True])
def test_cuda_graph_guard_sees_where_the_storage_was_allocated(up_front: bool) -> None:
    """``backend="mla"`` with CUDA graphs refuses a graph that allocates the cache's storage (a
    CUDA graph's next replay would overwrite it while the cache holds it): the check finds the
    allocation in a prompt pass traced with a fresh cache, and none where the storage exists
    before the call. (The refusal itself needs CUDA graphs, so a GPU, where it is exercised.)"""
    from mla_compile.fx_passes.backend import cache_allocated_in_graph

    graphs = []

    def capture(gm, example_inputs):  # what backend="mla" checks: the rewritten graph
        fx_passes.absorb_mla(gm)
        graphs.append(gm)
        return gm.forward

    model = tiny_model("deepseek_v3")
    ids, mask = left_padded_batch((5, 11), seed=4)
    sizes = dict(batch_size=2, dtype=torch.float64, device="cpu") if up_front else {}
    cache = hf_cache.MLACache(model.config, max_length=64, page_size=4, static=True, **sizes)
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend=capture, fullgraph=True)
    kw = dict(attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
    model.generate(ids, **kw, **hf_cache.cache_kwargs(model, cache))
    assert len(graphs) == 2  # the prompt pass, one decode step
    assert cache_allocated_in_graph(graphs[0]) is not up_front
    assert not cache_allocated_in_graph(graphs[1])
