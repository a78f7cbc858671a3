"""Prefill over the latent cache a chunk of keys at a time (``mla::prefill``) in real models.

Float64, tiny random models, left-padded batches; the rewrite forced to several chunks
(``RewriteOptions(prefill_chunk_tokens=16, prefill_original_bytes=0)``) so the LSE merge is
exercised. Truth: the original
model with SDPA and its default cache.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from mla_compile.fx_passes import RewriteOptions, mla_backend
from mla_compile.mla_ops import prefill as prefill_op
from mla_compile.mla_ops.hf_cache import cache_kwargs, output_cache
from tests.fx_passes.tiny_models import FAMILIES as TESTED_FAMILIES
from tests.fx_passes.tiny_models import (
    attention_layers,
    left_padded_batch,
    tiny_model,
    truth_model,
)

hf_cache = pytest.importorskip("mla_compile.mla_ops.hf_cache")
transformers = pytest.importorskip("transformers")
if tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 15):
    pytest.skip("the latent-cache families need transformers >= 5.15", allow_module_level=True)

# every prefill site chunked (the tiny models' expansions would fit the default budget)
CHUNKED = RewriteOptions(prefill_chunk_tokens=16, prefill_original_bytes=0)


def compiled(model, options: RewriteOptions = CHUNKED):
    torch._dynamo.reset()
    counters.clear()
    model.forward = torch.compile(
        model.forward, backend=mla_backend(options, inductor=False), fullgraph=True
    )
    return model


def make_cache(model, kind: str):
    if kind == "dynamic":
        return transformers.DynamicCache(config=model.config)
    return hf_cache.MLACache(model.config, max_length=96, page_size=4, static=True)


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize(
    ("family", "cache"),
    [
        (family, cache)
        for family, cache in (
            ("deepseek_v2", "dynamic"),
            ("deepseek_v3", "paged"),
            ("minicpm3", "paged"),
        )
        if family in TESTED_FAMILIES
    ],
)
def test_prefill_and_a_second_turn_match_the_original(family: str, cache: str) -> None:
    """DeepSeek-V2 (complex RoPE), V3 (interleaved), MiniCPM3 (3 heads). A 37-token left-padded
    prompt, then 12 more tokens over the cached prefix (a second turn):
    both passes are ``mla::prefill`` in several chunks, logits at real positions within 1e-10 of
    the float64 original, and the decode step after them too."""
    model = tiny_model(family)
    exact = truth_model(model)
    ids, mask = left_padded_batch((37, 20, 29), seed=3)
    more_ids, _ = left_padded_batch((12, 12, 12), seed=4)
    mask2 = torch.cat([mask, torch.ones_like(more_ids)], dim=1)
    real = mask.bool()
    with torch.no_grad():
        want1 = exact(ids, attention_mask=mask, use_cache=True)
        past = output_cache(want1)
        want2 = exact(more_ids, attention_mask=mask2, **cache_kwargs(exact, past))
        model = compiled(model)
        kv = make_cache(model, cache)
        got1 = model(ids, attention_mask=mask, use_cache=True, **cache_kwargs(exact, kv))
        plan = prefill_op.LAST_PLAN["prefill"]
        got2 = model(more_ids, attention_mask=mask2, **cache_kwargs(exact, kv))
        step_ids = want2.logits[:, -1:].argmax(-1)
        mask3 = torch.cat([mask2, torch.ones_like(step_ids)], dim=1)
        want3 = exact(step_ids, attention_mask=mask3, **cache_kwargs(exact, past))
        got3 = model(step_ids, attention_mask=mask3, **cache_kwargs(exact, kv))
    layers = attention_layers(model)
    assert counters["mla"]["prefill_sites"] == 2 * layers  # two prompt lengths, two graphs
    assert counters["mla"]["absorbed_sites"] == layers
    if cache == "paged":
        assert counters["mla"]["paged_sites"] == layers
    assert plan.num_chunks == 3 and plan.chunk_tokens == 16  # 37 keys
    assert prefill_op.LAST_PLAN["prefill"].keys_read == 37 + 12 or cache == "paged"
    assert relative(got1.logits[real], want1.logits[real]) <= 1e-10
    assert relative(got2.logits, want2.logits) <= 1e-10
    assert relative(got3.logits, want3.logits) <= 1e-10


@pytest.mark.parametrize("family", [f for f in ["deepseek_v3"] if f in TESTED_FAMILIES])
def test_generate_with_chunked_prompt(family: str) -> None:
    """``generate(prefill_chunk_size=12)`` over ``MLACache``: the prompt in pieces of 12 tokens,
    each attending over the pages so far with ``mla::prefill``, then absorbed decode; the
    original's 16 greedy tokens."""
    model = tiny_model(family)
    exact = truth_model(model)
    ids, mask = left_padded_batch((30, 17), seed=5)
    args = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    want = exact.generate(ids, **args)
    model = compiled(model)
    kv = hf_cache.MLACache(model.config, max_length=64, page_size=8, static=True)
    got = model.generate(ids, prefill_chunk_size=12, **cache_kwargs(exact, kv), **args)
    assert counters["mla"]["prefill_sites"] >= attention_layers(model)
    assert torch.equal(got, want)


def test_original_prefill_can_be_kept() -> None:
    """``RewriteOptions(prefill="original")``: the prompt pass keeps the model's own attention
    (no mla::prefill) and decode is still absorbed."""
    model = tiny_model("deepseek_v2")
    exact = truth_model(model)
    ids, mask = left_padded_batch((11, 9))
    with torch.no_grad():
        want = exact(ids, attention_mask=mask).logits
        got = compiled(model, RewriteOptions(prefill="original"))(ids, attention_mask=mask).logits
    assert counters["mla"]["prefill_sites"] == 0
    assert counters["mla"]["kept_sites"] == attention_layers(model)
    assert relative(got[mask.bool()], want[mask.bool()]) <= 1e-10


def test_cost_rule_keeps_a_small_expansion() -> None:
    """By default a prefill site whose whole expansion fits ``prefill_original_bytes`` keeps the
    original form (faster there), with the bytes in its reason; below the site's bytes it is
    chunked."""
    model = tiny_model("deepseek_v2")
    ids, mask = left_padded_batch((11, 9))
    with torch.no_grad():
        compiled(model, RewriteOptions())(ids, attention_mask=mask)
    assert counters["mla"]["prefill_sites"] == 0
    assert counters["mla"]["kept_sites"] == attention_layers(model)
    # B=2, T=11, H, P+R+V per head, and the [B, S, T] bias, float64
    config = model.config
    per_key = config.num_attention_heads * (
        config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim
    )
    expansion = 2 * 11 * (per_key + 11) * 8
    for limit, chunked in ((expansion, False), (expansion - 1, True)):
        with torch.no_grad():
            compiled(model, RewriteOptions(prefill_original_bytes=limit))(ids, attention_mask=mask)
        assert counters["mla"]["prefill_sites"] == (attention_layers(model) if chunked else 0)
