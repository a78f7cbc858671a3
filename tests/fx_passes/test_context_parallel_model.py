"""Decode context parallelism inside a model: ``MLACache(static=True,
context_parallel=ContextParallel())`` shards the latent cache by token across 2 gloo processes,
each running the whole model; the rewrite (``backend="mla_eager"``, fullgraph) reads each rank's
pages and merges the ranks' attention states. Float64, a left-padded batch: 32 greedy tokens and
the prompt's and every step's logits equal the single process's (1e-10) on every rank, each rank
holding about half the cache; the unrewritten model gives the same tokens (it gathers the whole
cache each step). DeepSeek-V2, DeepSeek-V3 and GLM-4 MoE Lite."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.fx_passes.tiny_models import FAMILIES as TESTED_FAMILIES
from tests.fx_passes.tiny_models import (
    attention_layers,
    generate_with_logits,
    left_padded_batch,
    no_whole_cache_gather,
    relative_error,
    tiny_model,
    truth_model,
)

transformers = pytest.importorskip("transformers")
from mla_compile.mla_ops.hf_cache import transformers_version  # noqa: E402

if transformers_version() < (5, 15):
    pytest.skip(
        "MLACache's context parallelism needs transformers >= 5.15", allow_module_level=True
    )

# as far as this run tests them (MLA_TEST_FAMILIES narrows the pinned-release runs)
FAMILIES = tuple(f for f in ("deepseek_v2", "deepseek_v3", "glm4_moe_lite") if f in TESTED_FAMILIES)
WORLD = 2
NEW_TOKENS = 32


def _cache(model, context_parallel):
    from mla_compile.mla_ops.hf_cache import MLACache

    return MLACache(
        model.config, max_length=48, page_size=4, static=True, batch_size=2,
        dtype=torch.float64, device="cpu", context_parallel=context_parallel,
    )  # fmt: skip


def _generate(model, cache, ids, mask):
    return generate_with_logits(model, cache, ids, mask, NEW_TOKENS)


def _worker(rank: int, root: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{root}/rendezvous", rank=rank,
                            world_size=WORLD)  # fmt: skip
    try:
        from torch._dynamo.utils import counters

        from mla_compile.mla_ops.context_parallel import ContextParallel

        ids, mask = left_padded_batch((5, 11), seed=3)
        for family in FAMILIES:
            model = tiny_model(family)
            exact = truth_model(model)
            want, want_logits = _generate(exact, None, ids, mask)
            whole = _cache(model, None)  # the single process's static cache (allocated now)
            if family == FAMILIES[0]:
                # unrewritten: attention reads every rank's rows, gathered (mla::cp_rows)
                plain = _cache(model, ContextParallel())
                got, _ = _generate(model, plain, ids, mask)
                assert torch.equal(got, want), family

            torch._dynamo.reset()
            counters.clear()
            model.forward = torch.compile(model.forward, backend="mla_eager", fullgraph=True)
            shared = _cache(model, ContextParallel())
            # the rewritten model reads its own pages: no whole-cache gather (mla::cp_rows's
            # dist.all_gather; the merge of the states is a functional collective) ever runs
            with no_whole_cache_gather():
                got, logits = _generate(model, shared, ids, mask)
            layers = attention_layers(model)
            assert torch.equal(got, want), family
            assert relative_error(logits, want_logits) <= 1e-10, family
            assert counters["mla"]["context_parallel_sites"] >= layers  # decode steps
            assert counters["mla"]["prefill_sites"] >= layers  # the 11-token prompt
            share, full = (
                shared.paged.cache_bytes(),
                sum(p.numel() * p.element_size() for p in whole.paged.all_pools),
            )
            page = 4 * (model.config.kv_lora_rank + model.config.qk_rope_head_dim) * 8
            layers_all = model.config.num_hidden_layers
            # half the pages, plus a page a sequence (rounding) and the scratch page, per layer
            assert share <= full / WORLD + 3 * page * layers_all, (family, share, full)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not FAMILIES, reason="none of the families is tested in this run")
def test_context_parallel_generate_equals_one_process(tmp_path) -> None:
    """A failing rank's exception and traceback come back through ``mp.spawn``."""
    mp.spawn(_worker, args=(str(tmp_path),), nprocs=WORLD)


def test_context_parallel_cache_refusals() -> None:
    from mla_compile.mla_ops.context_parallel import ContextParallel
    from mla_compile.mla_ops.hf_cache import MLACache

    model = tiny_model("deepseek_v2")
    with pytest.raises(ValueError, match="needs static=True"):
        MLACache(model.config, max_length=16, context_parallel=ContextParallel())
    with pytest.raises(TypeError, match="must be a ContextParallel"):
        MLACache(model.config, max_length=16, static=True, context_parallel="world")
    with pytest.raises(RuntimeError, match=r"needs torch\.distributed initialised"):
        MLACache(model.config, max_length=16, static=True, context_parallel=ContextParallel())


def _one_rank_worker(rank: int, root: str, backend: str, device: str) -> None:
    """One rank over ``backend`` (NCCL on a GPU): the context-parallel path with the device's
    kernels (the group of one still gathers, exchanges and merges) against the same model over
    an unsharded static cache; and ``context_parallel_decode`` with and without sharded heads
    against ``mla_decode``."""
    dist.init_process_group(backend, init_method=f"file://{root}/rendezvous", rank=0,
                            world_size=1)  # fmt: skip
    try:
        from mla_compile.mla_ops import context_parallel as cp
        from mla_compile.mla_ops import mla_decode
        from mla_compile.mla_ops.context_parallel import ContextParallel
        from mla_compile.mla_ops.hf_cache import MLACache

        if device == "cuda":
            torch.cuda.set_device(0)
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        # a group of one merges one state: the same numbers up to the dtype's rounding
        tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5
        gen = torch.Generator().manual_seed(5)
        q = torch.randn(3, 1, 16, 576, generator=gen).to(device, dtype)
        rows = torch.randn(3, 300, 576, generator=gen).to(device, dtype)
        lengths = torch.tensor([0, 1, 300], dtype=torch.int32, device=device)
        want = mla_decode(q, rows, lengths, head_dim_v=512, softmax_scale=0.1)
        for sharded in (False, True):
            got = cp.context_parallel_decode(
                q, rows, lengths, head_dim_v=512, softmax_scale=0.1, heads_sharded=sharded
            )
            torch.testing.assert_close(got[0], want[0], rtol=tolerance, atol=tolerance)
            torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)

        ids, mask = left_padded_batch((5, 11), seed=3)
        ids, mask = ids.to(device), mask.to(device)
        model = tiny_model("deepseek_v3", dtype=dtype).to(device)
        model.forward = torch.compile(model.forward, backend="mla", fullgraph=True)
        runs = []
        for context_parallel in (None, ContextParallel()):
            torch._dynamo.reset()
            cache = MLACache(
                model.config, max_length=48, page_size=4, static=True, batch_size=2,
                dtype=dtype, device=device, context_parallel=context_parallel,
            )  # fmt: skip
            runs.append(_generate(model, cache, ids, mask))
        (plain, plain_logits), (shared, shared_logits) = runs
        assert torch.equal(shared, plain)
        assert relative_error(shared_logits.float(), plain_logits.float()) <= tolerance
    finally:
        dist.destroy_process_group()


_NCCL = torch.cuda.is_available() and dist.is_nccl_available()


@pytest.mark.parametrize(
    ("backend", "device"),
    [
        ("gloo", "cpu"),
        pytest.param("nccl", "cuda", marks=pytest.mark.skipif(not _NCCL, reason="GPU, NCCL")),
    ],
)
def test_one_rank_compiled_with_inductor(tmp_path, backend: str, device: str) -> None:
    """The context-parallel path compiled by ``backend="mla"`` (Inductor: it asserts the ops'
    output layouts against their fake functions), on CPU over gloo and on a GPU over NCCL with
    the GPU's decode kernels."""
    mp.spawn(_one_rank_worker, args=(str(tmp_path), backend, device), nprocs=1)
