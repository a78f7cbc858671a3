"""Shared pieces of the export tests: tiny models, eager truth, graph inspection."""

from __future__ import annotations

import pytest
import torch

from export import DecodeStep, PrefillStep
from tests.fx_passes.tiny_models import tiny_model

transformers = pytest.importorskip("transformers")
if tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 15):
    pytest.skip("latent-cache attention needs transformers >= 5.15", allow_module_level=True)

EXPORT_FAMILIES = ["deepseek_v2", "deepseek_v3"]
# (batch, cache length) pairs run through one exported program; neither is the export example.
SHAPES = [(3, 7), (1, 40)]


def float32_model(family: str):
    return tiny_model(
        family, dtype=torch.float32, q_lora_rank=24 if family == "deepseek_v3" else None
    )


def llama_model():
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).float().eval()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


def eager_decode(model, args):
    with torch.no_grad():
        return DecodeStep(model)(*args)


def eager_prefill(model, args):
    with torch.no_grad():
        return PrefillStep(model)(*args)


def cache_len_symbol(program):
    """The symbol of the cache length T: dimension 2 of the first ``past`` input."""
    past = program.graph_signature.user_inputs[3]
    node = next(n for n in program.graph.nodes if n.name == past)
    (symbol,) = node.meta["val"].shape[2].node.expr.free_symbols
    return symbol


def cached_values_per_token(program) -> dict[str, int]:
    """``{node: values per cached token}`` for every tensor in the graph whose shape has a
    dimension of the cache length (T, T+1, ...): the product of its other (static) dimensions.
    MLA's latent rows hold L or R values per token; expanded K/V hold H x (P+R) or H x V."""
    symbol = cache_len_symbol(program)
    found = {}
    for node in program.graph.nodes:
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            continue
        if not any(
            not isinstance(d, int) and symbol in d.node.expr.free_symbols for d in value.shape
        ):
            continue
        static = 1
        for d in value.shape:
            if isinstance(d, int):
                static *= d
        found[node.name] = static
    return found
