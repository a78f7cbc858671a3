"""Shared pieces of the export tests: tiny models, eager truth, graph inspection."""

from __future__ import annotations

import pytest
import torch

from mla_compile.export import DecodeStep, PrefillStep
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


def decode_dims(args) -> tuple:
    """``dynamic_shapes`` of a ``DecodeStep``'s inputs: batch <= 64, cache length <= 200."""
    batch = torch.export.Dim("batch", min=1, max=64)
    past_len = torch.export.Dim("cache_len", min=1, max=200)
    cache = {0: batch, 2: past_len}
    return ({0: batch}, {0: batch, 1: past_len + 1}, {0: batch}, ((cache, cache),) * len(args[3]))


def plain_decode_export(model, args):
    """``torch.export`` of ``DecodeStep(model)`` as it is (no rewrite), ``decode_dims``."""
    with torch.no_grad():
        return torch.export.export(DecodeStep(model), args, dynamic_shapes=decode_dims(args))


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
