"""A Hugging Face causal LM's prefill and decode steps as modules with explicit cache tensors.

``torch.export`` and ONNX need plain tensors in and out. These wrappers take the KV cache as a
tuple of ``(keys, values)`` per layer (what ``DynamicCache`` holds: in transformers >= 5.15 the
latent ``[B, 1, T, L]`` and the roped ``k_pe`` ``[B, 1, T, R]``) and return the grown cache,
the "past in, present out" convention of ONNX LLM exports.
"""

from __future__ import annotations

import torch

CacheTensors = tuple[tuple[torch.Tensor, torch.Tensor], ...]


def _dynamic_cache(config, past: CacheTensors = ()):
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    for layer, (keys, values) in enumerate(past):
        cache.update(keys, values, layer)
    return cache


def _step(model, input_ids, attention_mask, position_ids, past: CacheTensors):
    """Run ``model`` over a ``DynamicCache`` holding ``past``: ``(logits, present)``."""
    from mla_compile.mla_ops.hf_cache import cache_kwargs  # imports transformers: needed only here

    cache = _dynamic_cache(model.config, past)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=True,
        **cache_kwargs(model, cache),
    )
    return out.logits, tuple((layer.keys, layer.values) for layer in cache.layers)


class PrefillStep(torch.nn.Module):
    """``forward(input_ids [B, S], attention_mask [B, S], position_ids [B, S])
    -> (logits [B, S, vocab], present)``: the prompt pass, which fills an empty cache."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, CacheTensors]:
        return _step(self.model, input_ids, attention_mask, position_ids, ())


class DecodeStep(torch.nn.Module):
    """``forward(input_ids [B, S], attention_mask [B, T+S], position_ids [B, S], past)
    -> (logits [B, S, vocab], present)``: S new tokens (1, or a few for multi-token prediction)
    over ``past``, a tuple of ``(keys [B, ., T, .], values [B, ., T, .])`` per layer;
    ``present`` is ``past`` grown by S tokens."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        past: CacheTensors,
    ) -> tuple[torch.Tensor, CacheTensors]:
        return _step(self.model, input_ids, attention_mask, position_ids, past)


def prompt_inputs(
    model: torch.nn.Module, batch_size: int, seq_len: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random ``(input_ids, attention_mask, position_ids)`` ``[B, S]`` on the model's device,
    the first sequence left-padded by one token when ``S > 1`` (so masks are exercised)."""
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    input_ids = torch.randint(0, vocab, (batch_size, seq_len), generator=gen)
    attention_mask = torch.ones(batch_size, seq_len, dtype=torch.long)
    if seq_len > 1:
        attention_mask[0, 0] = 0
    position_ids = _positions(attention_mask)
    return input_ids.to(device), attention_mask.to(device), position_ids.to(device)


def decode_inputs(
    model: torch.nn.Module, batch_size: int, cache_len: int, q_len: int = 1, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, CacheTensors]:
    """Example inputs of ``DecodeStep``: a real cache from a prefill of ``cache_len`` random
    tokens (so its shapes are whatever this model and transformers version store), then
    ``q_len`` new tokens."""
    ids, mask, _ = prompt_inputs(model, batch_size, cache_len + q_len, seed)
    positions = _positions(mask)
    with torch.no_grad():
        _, past = PrefillStep(model)(
            ids[:, :cache_len], mask[:, :cache_len], positions[:, :cache_len]
        )
    # Contiguous copies: an AOTInductor package assumes the strides of its example inputs.
    new_ids = ids[:, cache_len:].contiguous()
    return new_ids, mask, positions[:, cache_len:].contiguous(), past


def _positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Hugging Face's position ids for a left-padded batch: pads at 0, real tokens from 0."""
    return (attention_mask.cumsum(-1) - 1).clamp_min(0)
