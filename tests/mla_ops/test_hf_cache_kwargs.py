"""``cache_kwargs`` / ``output_cache``: the cache passed to a Hugging Face model and read back
under the name the installed transformers uses (``cache`` from 5.24, which deprecates
``past_key_values``; ``past_key_values`` before), with no deprecation warning. Runs under every
transformers release CI installs (also ``make test-legacy``)."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers")
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, DynamicCache

from mla_compile.export.steps import DecodeStep, decode_inputs
from mla_compile.mla_ops.hf_cache import cache_kwargs, output_cache, transformers_version


class NewStyle(torch.nn.Module):
    def forward(self, input_ids: torch.Tensor, cache=None) -> torch.Tensor:
        return input_ids


class OldStyle(torch.nn.Module):
    def forward(self, input_ids: torch.Tensor, past_key_values=None) -> torch.Tensor:
        return input_ids


def test_the_name_follows_the_forward_signature() -> None:
    cache = DynamicCache()
    assert cache_kwargs(NewStyle(), cache) == {"cache": cache}
    assert cache_kwargs(OldStyle(), cache) == {"past_key_values": cache}
    # torch.compile's wrapper takes *args, **kwargs: the wrapped module's signature decides.
    assert cache_kwargs(torch.compile(OldStyle()), cache) == {"past_key_values": cache}
    assert cache_kwargs(torch.compile(NewStyle()), None) == {"cache": None}


def test_a_non_module_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module, got str"):
        cache_kwargs("deepseek", DynamicCache())


@pytest.fixture(scope="module")
def model() -> DeepseekV3ForCausalLM:
    torch.manual_seed(0)
    config = DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
        n_group=1, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=16,
        q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
    )  # fmt: skip
    return DeepseekV3ForCausalLM(config).eval()


def test_generate_forward_and_export_step_warn_nothing(model) -> None:
    """The name chosen is the one this release takes without a FutureWarning (a wrong name under
    transformers >= 5.24 raises here), for generate, forward and the export steps; the cache
    comes back from each output."""
    if transformers_version() >= (5, 24):
        assert "cache" in cache_kwargs(model, None)
    ids = torch.randint(3, 64, (2, 5))
    cache = DynamicCache(config=model.config)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error", FutureWarning)
        out = model.generate(
            ids,
            max_new_tokens=3,
            do_sample=False,
            pad_token_id=0,
            return_dict_in_generate=True,
            **cache_kwargs(model, cache),
        )
        assert output_cache(out) is cache
        assert cache.get_seq_length() == 5 + 3 - 1
        step = model(out.sequences[:, -1:], use_cache=True, **cache_kwargs(model, cache))
        assert output_cache(step) is cache
        assert cache.get_seq_length() == 5 + 3
        logits, present = DecodeStep(model)(*decode_inputs(model, batch_size=2, cache_len=4))
    assert logits.shape == (2, 1, 64)
    assert present[0][0].shape[-2] == 5  # 4 cached tokens + the new one
