"""MLACache with transformers < 5.15, whose MLA attention caches expanded K/V (the CI run pinned
to such a release). The rewritten model's latent caching itself is tested, on every release, in
test_latent_cache_decode.py; here: what an unrewritten model gets, and the clear refusals."""

from __future__ import annotations

import pytest
import torch

from tests.fx_passes.tiny_models import (
    LATENT_ATTENTION,
    attention_layers,
    left_padded_batch,
    rewritten,
    tiny_model,
)

if LATENT_ATTENTION:
    pytest.skip("transformers >= 5.15 caches latents itself", allow_module_level=True)

from mla_compile.mla_ops.hf_cache import MLACache, cache_kwargs


def test_unrewritten_model_keeps_expanded_kv_and_says_so() -> None:
    """Growing mode, eager: a correct cache (the default cache's tokens) holding the expanded
    K/V it is handed, with a warning that names the way to latents."""
    model = tiny_model("deepseek_v3")
    ids, mask = left_padded_batch((5, 8), seed=1)
    args = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    want = model.generate(ids, **args)
    cache = MLACache(model.config, max_length=64, page_size=4, static=False)
    with pytest.warns(UserWarning, match=r"expanded per-head K/V.*backend='mla'"):
        got = model.generate(ids, **args, **cache_kwargs(model, cache))
    assert torch.equal(got, want)
    config = model.config
    per_head = config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim
    expanded = attention_layers(model) * config.num_attention_heads * per_head * 8
    assert cache.bytes_per_token() == expanded
    assert cache.paged is None  # no latent pages were allocated


def test_static_cache_needs_the_rewrite() -> None:
    model = tiny_model("deepseek_v3")
    ids, mask = left_padded_batch((3, 4), seed=2)
    cache = MLACache(model.config, max_length=32, page_size=4, static=True)
    with pytest.raises(RuntimeError, match=r"torch\.compile\(model\.forward, backend='mla'\)"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, **cache_kwargs(model, cache),
                       pad_token_id=0)  # fmt: skip


def test_mixing_expanded_and_latent_steps_is_refused() -> None:
    """A layer holding expanded rows refuses latent ones; and the way such a mix would arise
    (an eager, expanded prefill, then a compiled step on the same growing cache) is refused at the
    compiled step already."""
    model = tiny_model("deepseek_v3")
    ids, mask = left_padded_batch((3, 4), seed=3)
    cache = MLACache(model.config, max_length=32, page_size=4, static=False)
    with pytest.warns(UserWarning):
        model(ids, attention_mask=mask, **cache_kwargs(model, cache))
    layer = cache.layers[0]
    with pytest.raises(RuntimeError, match="holds expanded rows and was handed latent ones"):
        layer._set_mode("latent")
    compiled = rewritten(model)
    next_ids = torch.ones(2, 1, dtype=torch.long)
    mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
    with pytest.raises(Exception, match=r"static=True"):
        compiled(next_ids, attention_mask=mask, **cache_kwargs(model, cache))
