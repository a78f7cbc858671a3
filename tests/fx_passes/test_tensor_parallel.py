"""Tensor parallelism as transformers does it: a model loaded with
``DistributedConfig(tp_plan="auto")`` on 2 gloo processes (``q_b_proj`` / ``kv_b_proj`` split
by heads, ``o_proj`` by rows with its all-reduce, ``kv_a_proj_with_mqa`` replicated), compiled
with ``backend="mla_eager"`` (fullgraph) over an ``MLACache(static=True)`` per rank. The rewrite
takes each rank's local heads and its shard of ``kv_b_proj``; 32 greedy tokens of a left-padded
batch and every step's logits match the single process's (float64, 1e-10), on every rank, for
DeepSeek-V2, DeepSeek-V3 and GLM-4 MoE Lite. Then tensor x context parallelism: the cache also
sharded by token (``MLACache(context_parallel=...)``), over the same 2 ranks, and over pairs of
4 ranks with one head each; each rank holds ``1 / group`` of the cache."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.fx_passes.tiny_models import (
    generate_with_logits,
    left_padded_batch,
    no_whole_cache_gather,
    tiny_model,
)

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers' tensor-parallel loading needs it
from mla_compile.mla_ops.hf_cache import transformers_version  # noqa: E402

if transformers_version() < (5, 18):
    # DistributedConfig exists before, but the plans differ by family (5.14's DeepSeek-V3 keeps
    # kv_b_proj whole); the sharding described here is transformers' from 5.18.
    pytest.skip(
        "tensor-parallel plans as tested here: transformers >= 5.18", allow_module_level=True
    )
from transformers.distributed import DistributedConfig  # noqa: E402

FAMILIES = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite")
WORLD = 2
NEW_TOKENS = 32
MAX_LENGTH = 48  # an 11-token prompt and 32 new tokens
PAGE = 4


def _generate(model, cache):
    return generate_with_logits(model, cache, *left_padded_batch((7, 11)), NEW_TOKENS)


def _cache(config, context_parallel=None, max_length=MAX_LENGTH):
    from mla_compile.mla_ops.hf_cache import MLACache

    return MLACache(
        config, max_length=max_length, page_size=PAGE, static=True, batch_size=2,
        dtype=torch.float64, device="cpu", context_parallel=context_parallel,
    )  # fmt: skip


def _load(root: str, family: str):
    return transformers.AutoModelForCausalLM.from_pretrained(
        f"{root}/{family}", dtype=torch.float64, experts_implementation="batched_mm",
        distributed_config=DistributedConfig(tp_plan="auto"),
    ).eval()  # fmt: skip


def _context_parallel_run(model, group=None):
    """``generate`` over a cache sharded by token across ``group``, the model's heads sharded
    too; the whole-cache gather is forbidden (every site reads its rank's pages). Returns the
    tokens, logits, rewrite counters and this rank's cache bytes."""
    from torch._dynamo.utils import counters

    from mla_compile.mla_ops.context_parallel import ContextParallel

    torch._dynamo.reset()
    counters.clear()
    shared = _cache(model.config, ContextParallel(group))
    with no_whole_cache_gather():
        tokens, logits = _generate(model, shared)
    return tokens, logits, dict(counters["mla"]), shared.paged.cache_bytes()


def _init(rank: int, root: str, world: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"file://{root}/rendezvous", rank=rank,
                            world_size=world)  # fmt: skip


def _worker(rank: int, root: str) -> None:
    _init(rank, root, WORLD)
    try:
        from torch._dynamo.utils import counters

        from mla_compile.mla_ops.context_parallel import ContextParallel

        for family in FAMILIES:
            model = _load(root, family)
            weight = model.model.layers[0].self_attn.kv_b_proj.weight  # sharded by heads
            local = weight.to_local() if hasattr(weight, "to_local") else weight
            text = model.config
            rows = text.num_attention_heads * (text.qk_nope_head_dim + text.v_head_dim)
            assert local.shape[0] * WORLD == rows, (family, tuple(local.shape), rows)
            if family == FAMILIES[0]:
                # a context-parallel cache made for whole heads is refused for this model
                whole_heads = tiny_model(family).config
                with pytest.raises(ValueError, match="made for a model with whole heads"):
                    _generate(model, _cache(whole_heads, ContextParallel()))
                # ranks whose caches differ are told so, on every rank, before any step
                from mla_compile.mla_ops.hf_cache import cache_kwargs

                odd = _cache(model.config, ContextParallel(), max_length=MAX_LENGTH + 8 * rank)
                with pytest.raises(ValueError, match=r"differ in max_length \(\{'max_length'"):
                    cache_kwargs(model, odd)
                # unrewritten, over the sharded cache: every rank's rows gathered (cp_rows)
                tokens, _ = _generate(model, _cache(model.config, ContextParallel()))
                torch.save(tokens, f"{root}/{family}_plain_rank{rank}.pt")
            torch._dynamo.reset()
            counters.clear()
            model.forward = torch.compile(model.forward, backend="mla_eager", fullgraph=True)
            tokens, logits = _generate(model, _cache(model.config))
            sites = dict(counters["mla"])
            torch.save((tokens, logits, sites), f"{root}/{family}_rank{rank}.pt")
            # tensor x context parallelism: the same group shards heads and tokens
            torch.save(_context_parallel_run(model), f"{root}/{family}_cp_rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _cache_bytes(config) -> int:
    cache = _cache(config)
    return sum(p.numel() * p.element_size() for p in cache.paged.all_pools)


def _share_bound(config, world: int) -> float:
    """``1 / world`` of the single process's pools, plus a page a sequence (rounding) and the
    scratch page, per layer."""
    page = PAGE * (config.kv_lora_rank + config.qk_rope_head_dim) * 8
    return _cache_bytes(config) / world + 3 * page * config.num_hidden_layers


def test_tensor_parallel_heads_match_one_process(tmp_path) -> None:
    """Tensor parallelism alone, then with the cache sharded by token across the same group.
    A failing rank's exception and traceback come back through ``mp.spawn``."""
    want, configs = {}, {}
    for family in FAMILIES:
        model = tiny_model(family)  # float64, 4 heads: 2 per rank
        model.save_pretrained(tmp_path / family)
        want[family] = _generate(model, None)
        configs[family] = model.config
    mp.spawn(_worker, args=(str(tmp_path),), nprocs=WORLD)
    for family in FAMILIES:
        tokens_want, logits_want = want[family]
        for rank in range(WORLD):
            tokens, logits, sites = torch.load(tmp_path / f"{family}_rank{rank}.pt")
            assert torch.equal(tokens, tokens_want), (family, rank)
            torch.testing.assert_close(logits, logits_want, rtol=1e-10, atol=1e-10)
            # the decode step's sites read the rank's pages (the prefill's stay un-absorbed)
            assert sites.get("paged_sites", 0) >= 2, (family, rank, sites)
            tokens, logits, sites, share = torch.load(tmp_path / f"{family}_cp_rank{rank}.pt")
            assert torch.equal(tokens, tokens_want), (family, rank, "tp x cp")
            torch.testing.assert_close(logits, logits_want, rtol=1e-10, atol=1e-10)
            assert sites.get("context_parallel_sites", 0) >= 2, (family, rank, sites)
            assert share <= _share_bound(configs[family], WORLD), (family, share)
            if family == FAMILIES[0]:
                plain = torch.load(tmp_path / f"{family}_plain_rank{rank}.pt")
                assert torch.equal(plain, tokens_want), (family, rank, "unrewritten")


SUBGROUP_WORLD, SUBGROUP = 4, 2


def _subgroup_worker(rank: int, root: str) -> None:
    """4 ranks, 1 head each; the cache sharded by token across ranks {0, 1} and {2, 3}."""
    _init(rank, root, SUBGROUP_WORLD)
    try:
        groups = [dist.new_group(list(range(s, s + SUBGROUP))) for s in (0, SUBGROUP)]
        model = _load(root, "deepseek_v3")
        model.forward = torch.compile(model.forward, backend="mla_eager", fullgraph=True)
        run = _context_parallel_run(model, groups[rank // SUBGROUP])
        torch.save(run, f"{root}/subgroup_rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_with_context_parallel_subgroups(tmp_path) -> None:
    """Tensor parallelism over 4 ranks, the cache sharded by token across pairs of them: each
    pair gathers its two heads' queries, each rank holds half the tokens."""
    model = tiny_model("deepseek_v3")
    model.save_pretrained(tmp_path / "deepseek_v3")
    tokens_want, logits_want = _generate(model, None)
    mp.spawn(_subgroup_worker, args=(str(tmp_path),), nprocs=SUBGROUP_WORLD)
    for rank in range(SUBGROUP_WORLD):
        tokens, logits, sites, share = torch.load(tmp_path / f"subgroup_rank{rank}.pt")
        assert torch.equal(tokens, tokens_want), rank
        torch.testing.assert_close(logits, logits_want, rtol=1e-10, atol=1e-10)
        assert sites.get("context_parallel_sites", 0) >= 2, (rank, sites)
        assert share <= _share_bound(model.config, SUBGROUP), (rank, share)
