"""Models built exactly the way transformers builds them by default (no ``experts_implementation``:
the experts run grouped products) through the rewrite, the cache and float64.

In eager mode on CPU such a model cannot run in float64 at all (torch's grouped product takes no
float64, and transformers takes its own float64-capable op only under compile); compiled with
``backend="mla"`` it can, and gives the float64 truth's tokens and logits. Export, AOTInductor
and ONNX of the default build: ``tests/export`` (their models are built this way).
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from mla_compile.mla_ops.hf_cache import LATENT_ATTENTION, MLACache, cache_kwargs
from tests.fx_passes.tiny_models import (
    _config,
    attention_layers,
    left_padded_batch,
    relative_error,
    rewritten,
    truth_model,
)

transformers = pytest.importorskip("transformers")

FAMILY_CLASSES = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


def default_build(family: str, dtype: torch.dtype = torch.float64):
    """``_from_config(config, dtype=...)`` and nothing else: transformers' defaults."""
    torch.manual_seed(0)
    config = _config(family, 24 if family == "deepseek_v3" else None, yarn=True)
    return getattr(transformers, FAMILY_CLASSES[family])._from_config(config, dtype=dtype).eval()


@pytest.mark.parametrize("family", sorted(FAMILY_CLASSES))
def test_the_default_build_runs_grouped_experts(family: str) -> None:
    """The premise: the default build's experts are grouped products, which eager float64 on
    CPU refuses (if torch learns float64 grouped products, this test says so)."""
    model = default_build(family)
    assert model.config._experts_implementation == "grouped_mm"
    ids, mask = left_padded_batch((4, 6))
    with pytest.raises(RuntimeError, match="Double"):
        model(ids, attention_mask=mask)


@pytest.mark.parametrize("cache", ["default", "MLACache"])
@pytest.mark.parametrize("family", sorted(FAMILY_CLASSES))
def test_default_build_float64_generate_equals_the_truth(family: str, cache: str) -> None:
    """Greedy tokens of the rewritten default build equal the float64 truth's, with the model's
    own cache and with ``MLACache``; the first step's logits within 1e-10."""
    if cache == "default" and not LATENT_ATTENTION:
        pytest.skip(
            f"transformers {transformers.__version__} caches expanded K/V in its default cache, "
            "which the rewrite leaves as it is (test_legacy_cache.py)"
        )
    model = default_build(family)
    exact = truth_model(model)
    ids, mask = left_padded_batch((5, 11), seed=2)
    args = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    want = exact.generate(ids, **args, output_logits=True, return_dict_in_generate=True)
    extra = {}
    if cache == "MLACache":
        latent = MLACache(model.config, max_length=32, page_size=8, static=True)
        extra = cache_kwargs(model, latent)
    got = rewritten(model).generate(
        ids, **args, **extra, output_logits=True, return_dict_in_generate=True
    )
    assert counters["mla"]["absorbed_sites"] >= attention_layers(model)
    assert torch.equal(got.sequences, want.sequences)
    assert relative_error(got.logits[1], want.logits[1]) <= 1e-10
