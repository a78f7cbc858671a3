"""The rewrite on tiny random Hugging Face MLA models of every tested family (transformers >= 5.15).

Float64 truth is the original model with ``attn_implementation="sdpa"``: Hugging Face's eager
attention runs its softmax in float32 even for float64 models (and, with left padding, its
float64 eager prefill writes NaN at pad positions), so an eager original is not a float64
reference. The rewritten eager models are compared with it at float32-softmax tolerance as well.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from mla_compile.mla_ops.hf_cache import cache_kwargs, output_cache
from tests.fx_passes.tiny_models import (
    EAGER_ONLY,
    FAMILIES,
    NOT_FOR_MLA_CACHE,
    SPARSE_ATTENTION,
    attention_layers,
    latent_attention,
    left_padded_batch,
    llama_model,
    relative_error,
    rewritten,
    skip_unless_latent_attention,
    tiny_model,
    truth_model,
)

transformers = pytest.importorskip("transformers")
if tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 15):
    pytest.skip("latent-cache attention needs transformers >= 5.15", allow_module_level=True)


def decode_step_logits(model, exact, ids, mask):
    """Prefill with ``exact``, then one decode step through ``exact`` and rewritten ``model``."""
    with torch.no_grad():
        out = exact(ids, attention_mask=mask, use_cache=True)
        next_ids = out.logits[:, -1:].argmax(-1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        cache_copy = copy.deepcopy(output_cache(out))
        want = exact(next_ids, attention_mask=mask, **cache_kwargs(model, output_cache(out))).logits
        original = model(
            next_ids, attention_mask=mask, **cache_kwargs(model, copy.deepcopy(cache_copy))
        )
        got = rewritten(model)(
            next_ids, attention_mask=mask, **cache_kwargs(model, cache_copy)
        ).logits
    return got, want, original.logits


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_decode_step_float64(family: str, attn: str) -> None:
    skip_unless_latent_attention(family)
    model = tiny_model(family, attn=attn, yarn=family != "kimi_linear")
    exact = truth_model(model)
    ids, mask = left_padded_batch((4, 11, 7))
    got, want, original = decode_step_logits(model, exact, ids, mask)
    assert counters["mla"]["absorbed_sites"] == attention_layers(model)
    assert relative_error(got, want) <= 1e-10
    if attn == "eager":  # the original eager model is only float32-softmax accurate
        assert relative_error(original, want) <= 1e-5


@pytest.mark.parametrize(
    ("family", "q_lora_rank", "yarn"),
    [
        ("deepseek_v3", None, True),  # interleaved RoPE, YaRN mscale in the softmax scale
        ("deepseek_v3", 24, False),
        ("deepseek_v2", None, False),  # complex (freqs_cis) RoPE
        ("deepseek_v2", 24, True),
    ],
)
def test_decode_step_variants(family: str, q_lora_rank: int | None, yarn: bool) -> None:
    model = tiny_model(family, q_lora_rank=q_lora_rank, yarn=yarn)
    ids, mask = left_padded_batch((9, 3))
    got, want, _ = decode_step_logits(model, truth_model(model), ids, mask)
    assert counters["mla"]["absorbed_sites"] == attention_layers(model)
    assert relative_error(got, want) <= 1e-10


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-4), (torch.bfloat16, None)])
def test_decode_step_low_precision(dtype: torch.dtype, tolerance: float | None) -> None:
    """float32: <= 1e-4 of the float64 truth. bfloat16: the dtype's tolerance, i.e. no further
    from the truth than the original bfloat16 model (plus a few bf16 ulps: 2 ** -6)."""
    model = tiny_model("deepseek_v3", dtype=dtype)
    exact = truth_model(model)
    ids, mask = left_padded_batch((5, 8))
    with torch.no_grad():
        out = model(ids, attention_mask=mask, use_cache=True)
        next_ids = out.logits[:, -1:].argmax(-1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        # float64 truth from the low-precision prefill's cache, so only the decode step differs
        cache64 = copy.deepcopy(output_cache(out))
        for layer in cache64.layers:
            layer.keys, layer.values = layer.keys.double(), layer.values.double()
        want = exact(next_ids, attention_mask=mask, **cache_kwargs(model, cache64)).logits
        past = copy.deepcopy(output_cache(out))
        original = model(next_ids, attention_mask=mask, **cache_kwargs(model, past)).logits
        got = rewritten(model)(
            next_ids, attention_mask=mask, **cache_kwargs(model, output_cache(out))
        )
    error = relative_error(got.logits.double(), want)
    if tolerance is None:
        tolerance = relative_error(original.double(), want) + 2.0**-6
    assert error <= tolerance, (error, tolerance)


# The eager-attention generation for one family of each attention code path: the dense MLA
# (complex and interleaved RoPE, three heads, LongCat's), and one DeepSeek Sparse Attention family;
# test_decode_step_float64 covers every family with both attention implementations.
EAGER_GENERATE = ["deepseek_v2", "deepseek_v3", "minicpm3", "longcat_flash", "deepseek_v32"]
# With SDPA and the default cache: those, and the families MLACache does not take (every other
# family generates its 32 tokens over MLACache in test_latent_cache_decode.py, and every one has
# its decode step checked to 1e-10 with the default cache in test_decode_step_float64).
SDPA_GENERATE = EAGER_GENERATE + [f for f in NOT_FOR_MLA_CACHE if f not in EAGER_GENERATE]


@pytest.mark.parametrize(
    ("family", "attn"),
    [(f, "sdpa") for f in SDPA_GENERATE if f in FAMILIES]
    + [(f, "eager") for f in EAGER_GENERATE if f in FAMILIES],
)
def test_greedy_generate_float64(family: str, attn: str) -> None:
    """32 new tokens, left-padded batch of different prompt lengths, identical to the original.

    SDPA: the 11-token prompt is prefill (S_q > 8, kept un-absorbed); every decode step is
    rewritten. Eager: prompts stay <= 8 tokens so the prefill is rewritten too (the original
    eager float64 prefill would write NaN at the pad positions).
    """
    skip_unless_latent_attention(family)
    model = tiny_model(family, attn=attn, yarn=family != "kimi_linear")
    exact = truth_model(model)
    ids, mask = left_padded_batch((5, 11) if attn == "sdpa" else (3, 8), seed=1)
    args = dict(attention_mask=mask, max_new_tokens=32, do_sample=False, pad_token_id=0)
    want = exact.generate(ids, **args)
    got = rewritten(model).generate(ids, **args)
    assert counters["mla"]["absorbed_sites"] >= attention_layers(model)
    assert torch.equal(got, want)


@pytest.mark.parametrize("family", [f for f in SPARSE_ATTENTION if f in FAMILIES])
def test_sparse_attention_mask_hides_keys(family: str) -> None:
    """The sparse families' equality tests are not dense attention in disguise: with the tests'
    top-k the original's decode step differs from the same weights keeping every key, and the
    rewritten step follows the sparse one."""
    skip_unless_latent_attention(family)
    model = tiny_model(family)
    exact = truth_model(model)
    ids, mask = left_padded_batch((4, 11, 7))
    got, want, _ = decode_step_logits(model, exact, ids, mask)
    indexers = [m for m in exact.modules() if hasattr(m, "index_topk")]
    assert indexers
    for module in indexers:
        module.index_topk = 10**6  # every key kept
    _, dense, _ = decode_step_logits(model, exact, ids, mask)
    assert relative_error(dense, want) > 1e-3
    assert relative_error(got, want) <= 1e-10


@pytest.mark.parametrize(
    "family", [f for f in SPARSE_ATTENTION if f in FAMILIES and not latent_attention(f)]
)
def test_sparse_attention_over_expanded_kv_is_left_as_it_is(family: str) -> None:
    """transformers 5.15-5.17 run the sparse-attention families' indexer around expanded K/V
    (the values come from the cache, not from the latent's projection): the rewrite leaves
    their attention as it is, and the compiled step still gives the float64 original's logits.
    No cases on other releases."""
    model = tiny_model(family)
    ids, mask = left_padded_batch((4, 11, 7))
    got, want, _ = decode_step_logits(model, truth_model(model), ids, mask)
    assert counters["mla"]["absorbed_sites"] == 0
    assert relative_error(got, want) <= 1e-10


@pytest.mark.parametrize(
    "family", [f for f, config in EAGER_ONLY.items() if hasattr(transformers, config)]
)
def test_attention_sinks_float64(family: str) -> None:
    """hy_v4's (and its VLM hy_v4_vl's) softmax takes a learned sink logit per head beside the
    scores (eager attention only; its max subtracted first): the rewritten decode step scales each
    row by sigmoid(lse - sink), within 1e-10 of the original, and greedy generate gives its
    tokens."""
    skip_unless_latent_attention(family)
    model = tiny_model(family, attn="eager")
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sinks"):  # 0 at init: random, so that the sinks take weight
                param.copy_(torch.randn(param.shape, generator=gen, dtype=param.dtype))
    ids, mask = left_padded_batch((4, 8), seed=2)
    args = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    # a copy generates: a VLM (hy_v4_vl) keeps rope offsets from generate() that a later
    # forward call without them would misread
    want_tokens = copy.deepcopy(model).generate(ids, **args)
    got, want, _ = decode_step_logits(model, model, ids, mask)
    assert counters["mla"]["absorbed_sites"] == attention_layers(model)
    assert relative_error(got, want) <= 1e-10
    got_tokens = model.generate(ids, **args)  # the forward is compiled now
    assert counters["mla"]["absorbed_sites"] >= 2 * attention_layers(model)
    assert torch.equal(got_tokens, want_tokens)


def test_no_mla_model_is_untouched() -> None:
    model = llama_model()
    ids, mask = left_padded_batch((6, 4))
    args = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    want = model.generate(ids, **args)
    got = rewritten(model).generate(ids, **args)
    assert counters["mla"]["absorbed_sites"] == 0 and counters["mla"]["skipped_sites"] == 0
    assert torch.equal(got, want)


def test_inductor_backend_generate() -> None:
    """backend="mla": the rewrite, then Inductor (CPU here), through plain torch.compile."""
    model = tiny_model("deepseek_v3", dtype=torch.float32)
    ids, mask = left_padded_batch((5, 11), seed=2)
    args = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    want = model.generate(ids, **args)
    got = rewritten(model, backend="mla").generate(ids, **args)
    assert counters["mla"]["absorbed_sites"] >= attention_layers(model)
    assert torch.equal(got, want)


def test_hugging_face_compile_config() -> None:
    """generate(compile_config=CompileConfig(backend="mla")) with a static cache; mode
    "reduce-overhead" (CompileConfig's default) is passed through to Inductor."""
    model = tiny_model("deepseek_v2", dtype=torch.float32)
    ids, mask = left_padded_batch((5, 3), seed=3)
    args = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    want = model.generate(ids, **args)
    config = transformers.CompileConfig(backend="mla", fullgraph=True, mode="reduce-overhead")
    config._compile_all_devices = True  # Hugging Face compiles only on accelerators by default
    torch._dynamo.reset()
    counters.clear()
    got = model.generate(ids, **args, cache_implementation="static", compile_config=config)
    assert counters["mla"]["absorbed_sites"] == attention_layers(model)
    assert torch.equal(got, want)
