"""MLACache under Hugging Face generate(): same tokens as DynamicCache (transformers >= 5.15)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

pytest.importorskip("transformers")
from mla_compile.mla_ops.hf_cache import LATENT_ATTENTION, MLACache, cache_kwargs

if not LATENT_ATTENTION:  # the latent path of older releases: tests/fx_passes/test_legacy_cache.py
    pytest.skip("unrewritten latent caching needs transformers >= 5.15", allow_module_level=True)

from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
)

TINY = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
    n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
    experts_implementation="eager",  # the grouped-mm experts take no float64
)  # fmt: skip
FAMILIES = {
    "deepseek_v3": lambda: DeepseekV3ForCausalLM(DeepseekV3Config(q_lora_rank=48, **TINY)),
    "deepseek_v2": lambda: DeepseekV2ForCausalLM(DeepseekV2Config(q_lora_rank=None, **TINY)),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model(request):
    torch.manual_seed(0)
    return FAMILIES[request.param]().double().eval()


def left_padded_batch():
    """Three prompts of lengths 7, 4 and 6, left padded with token 0."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (3, 7), generator=gen)
    mask = torch.ones_like(ids)
    for row, pad in ((1, 3), (2, 1)):
        ids[row, :pad], mask[row, :pad] = 0, 0
    return dict(input_ids=ids, attention_mask=mask, pad_token_id=0)


def generate(model, cache=None, **kw):
    torch.manual_seed(123)  # for sampling
    return model.generate(**left_padded_batch(), **cache_kwargs(model, cache), **kw)


@pytest.mark.parametrize(("page_size", "static"), [(1, False), (4, False), (64, True), (3, True)])
def test_greedy_tokens_identical(model, page_size: int, static: bool) -> None:
    kw = dict(max_new_tokens=32, do_sample=False)
    reference = generate(model, **kw)
    cache = MLACache(model.config, max_length=64, page_size=page_size, static=static)
    assert torch.equal(generate(model, cache, **kw), reference)
    assert cache.get_seq_length() == 7 + 32 - 1  # the last token is never fed back
    assert cache.paged.bytes_per_token_per_layer() == (32 + 16) * 8  # float64 latent row


def test_sampling_identical(model) -> None:
    kw = dict(max_new_tokens=24, do_sample=True, top_k=20, temperature=0.9)
    assert torch.equal(generate(model, MLACache(model.config, max_length=64), **kw),
                       generate(model, **kw))  # fmt: skip


def test_beam_search_identical(model) -> None:
    kw = dict(max_new_tokens=16, num_beams=3, do_sample=False)
    assert torch.equal(generate(model, MLACache(model.config, max_length=64), **kw),
                       generate(model, **kw))  # fmt: skip


def test_prompt_lookup_decoding_crops(model) -> None:
    """Candidate tokens are verified and rejected ones cropped from the cache."""
    kw = dict(max_new_tokens=24, do_sample=False, prompt_lookup_num_tokens=3)
    batch = left_padded_batch()
    batch = {k: v[:1] if torch.is_tensor(v) else v for k, v in batch.items()}  # batch size 1
    reference = model.generate(**batch, **kw)
    cache = MLACache(model.config, max_length=64, page_size=4)
    assert torch.equal(model.generate(**batch, **cache_kwargs(model, cache), **kw), reference)


def test_reset_between_generations(model) -> None:
    kw = dict(max_new_tokens=20, do_sample=False)
    cache = MLACache(model.config, max_length=64, page_size=8, static=True)
    first = generate(model, cache, **kw)
    cache.reset()
    assert cache.get_seq_length() == 0
    assert torch.equal(generate(model, cache, **kw), first)


def test_a_compiled_reuse_after_reset_compiles_nothing() -> None:
    """reset() between prompts: with the storage allocated up front, the first generation's
    prefill and decode graphs (a model built the default way compiles in one graph each) serve
    every later one, and each gives a fresh cache's tokens."""
    from tests.fx_passes.tiny_models import tiny_model

    model = tiny_model("deepseek_v3", dtype=torch.float32)
    want = generate(model, max_new_tokens=6, do_sample=False)
    torch._dynamo.reset()
    counters.clear()
    model.forward = torch.compile(model.forward, backend="mla_eager", fullgraph=True)
    cache = MLACache(
        model.config, max_length=64, page_size=8, static=True,
        batch_size=3, dtype=torch.float32, device="cpu",
    )  # fmt: skip
    for _ in range(3):
        cache.reset()
        assert torch.equal(generate(model, cache, max_new_tokens=6, do_sample=False), want)
    assert counters["stats"]["unique_graphs"] == 2  # one prefill, one decode graph
    torch._dynamo.reset()


def test_a_new_prompt_without_reset_is_refused(model) -> None:
    """generate() reads a cache's tokens as the start of the prompt: a prompt no longer than
    them leaves nothing to run, and the error says to reset() (rather than failing on an empty
    tensor inside the model)."""
    cache = MLACache(model.config, max_length=64, page_size=8, static=True)
    generate(model, cache, max_new_tokens=8, do_sample=False)  # prompts of 7: 14 tokens cached
    with pytest.raises(ValueError, match=r"holds 14 tokens .* call cache\.reset\(\)"):
        generate(model, cache, max_new_tokens=8, do_sample=False)


def test_a_growing_cache_under_compile_says_so_first(model) -> None:
    """The refusal's advice is the exception's first line, not dynamo's wrapper around it."""
    torch._dynamo.reset()
    compiled = copy.copy(model)
    compiled.forward = torch.compile(model.forward, backend="mla_eager")
    cache = MLACache(model.config, max_length=64, static=False)
    with pytest.raises(RuntimeError) as caught:
        generate(compiled, cache, max_new_tokens=2, do_sample=False)
    assert str(caught.value).startswith("MLACache(static=False) grows its pages"), caught.value
    torch._dynamo.reset()


def test_up_front_allocation_on_a_device_named_with_an_index() -> None:
    """``device="cuda"`` and ``"cuda:0"`` (here ``"cpu:0"`` and ``"cpu"``) name one device: the
    storage keeps the one tensors report, and rows from it are accepted."""
    config = DeepseekV3Config(q_lora_rank=48, **TINY)
    cache = MLACache(
        config, max_length=16, static=True, batch_size=1, dtype=torch.float32, device="cpu:0"
    )
    width, rope = config.kv_lora_rank, config.qk_rope_head_dim
    cache.update(torch.randn(1, 1, 2, width), torch.randn(1, 1, 2, rope), 0)
    assert int(cache.get_seq_length()) == 2


def test_partial_allocation_arguments_are_refused() -> None:
    config = DeepseekV3Config(q_lora_rank=48, **TINY)
    with pytest.raises(ValueError, match=r"batch_size, dtype and device .* come together"):
        MLACache(config, max_length=16, batch_size=2)


def test_expanded_states() -> None:
    """Per-head K/V (remote-code attention, transformers < 5.15): a growing cache keeps them as
    they are, with a warning; a static one needs the rewrite and says so."""
    config = DeepseekV3Config(q_lora_rank=48, **TINY)
    keys, values = torch.randn(1, 4, 2, 32), torch.randn(1, 4, 2, 16)
    cache = MLACache(config, max_length=16)
    with pytest.warns(UserWarning, match="expanded per-head K/V"):
        got = cache.update(keys, values, 0)
    assert got[0] is keys and cache.layers[0].mode == "expanded"
    static = MLACache(config, max_length=16, static=True)
    with pytest.raises(RuntimeError, match="backend='mla'"):
        static.update(keys, values, 0)


def test_latent_rows_of_the_wrong_width_are_an_error() -> None:
    """Rows in the latents' layout whose widths are not the config's are refused by name; they
    never switch the layer to storing expanded K/V."""
    config = DeepseekV3Config(q_lora_rank=48, **TINY)
    cache = MLACache(config, max_length=16)
    width, rope = config.kv_lora_rank, config.qk_rope_head_dim
    with pytest.raises(ValueError, match=rf"widths \(kv_c {width + 1}, k_pe {rope}\).*"
                       rf"kv_lora_rank={width} and qk_rope_head_dim={rope}"):  # fmt: skip
        cache.update(torch.randn(1, 1, 2, width + 1), torch.randn(1, 1, 2, rope), 0)
    assert cache.layers[0].mode is None
    cache.update(torch.randn(1, 1, 2, width), torch.randn(1, 1, 2, rope), 0)
    assert cache.layers[0].mode == "latent" and cache.get_seq_length() == 2


def test_capacity_exceeded_under_a_compile_backend_is_an_error() -> None:
    """Compiled by a backend other than ``mla`` (no rewrite), a static cache's capacity is not
    checked on the host; the overlong sequence's pages are then read by ``mla::paged_rows``,
    which refuses the length (on CUDA, without value checks: NaN rows), never drifting. One
    family: the check is the cache's, not the model's."""
    torch.manual_seed(0)
    model = FAMILIES["deepseek_v3"]().double().eval()
    cache = MLACache(model.config, max_length=8, page_size=4, static=True)  # capacity: 8 rows
    torch._dynamo.reset()
    compiled = copy.copy(model)
    compiled.forward = torch.compile(model.forward, backend="aot_eager")
    with pytest.raises(ValueError, match=r"cache_seqlens must be in \[0, 8\]"):
        generate(compiled, cache, max_new_tokens=8, do_sample=False)
    torch._dynamo.reset()


def test_capacity_exceeded_is_a_clear_error(model) -> None:
    cache = MLACache(model.config, max_length=10, static=True)
    with pytest.raises(
        ValueError, match=r"cache capacity exceeded: 10 \+ 1 tokens > max_length=10"
    ):
        generate(model, cache, max_new_tokens=8, do_sample=False)


@pytest.mark.parametrize("static", [False, True])
def test_batch_selection_and_repeat(model, static: bool) -> None:
    """batch_select_indices / batch_repeat_interleave, then a decode step: the same logits as
    DynamicCache after the same batch change."""
    from transformers import DynamicCache

    batch = left_padded_batch()
    ids, mask = batch["input_ids"], batch["attention_mask"]
    for change, rows in (("select", [2, 0]), ("repeat", [2, 2, 0, 0]), ("mask", [0, 2])):
        logits = []
        for past in (
            DynamicCache(config=model.config),
            MLACache(model.config, max_length=64, page_size=4, static=static, num_pages=512),
        ):
            with torch.no_grad():
                out = model(ids, attention_mask=mask, **cache_kwargs(model, past))
                if change == "mask":  # a bool mask keeps the rows where it is True
                    past.batch_select_indices(torch.tensor([True, False, True]))
                else:
                    past.batch_select_indices(torch.tensor([2, 0]))
                if change == "repeat":
                    past.batch_repeat_interleave(2)
                next_ids = out.logits[rows, -1:].argmax(-1)
                step_mask = torch.cat([mask[rows], torch.ones(len(rows), 1, dtype=mask.dtype)], 1)
                logits.append(
                    model(next_ids, attention_mask=step_mask, **cache_kwargs(model, past)).logits
                )
        torch.testing.assert_close(logits[1], logits[0], rtol=1e-10, atol=1e-10)
