"""Tensor parallelism as transformers does it: a model loaded with
``DistributedConfig(tp_plan="auto")`` on 2 gloo processes (``q_b_proj`` / ``kv_b_proj`` split
by heads, ``o_proj`` by rows with its all-reduce, ``kv_a_proj_with_mqa`` replicated), compiled
with ``backend="mla_eager"`` (fullgraph) over an ``MLACache(static=True)`` per rank. The rewrite
takes each rank's local heads and its shard of ``kv_b_proj``; 8 greedy tokens of a left-padded
batch and every step's logits match the single process's (float64, 1e-10), on every rank, for
DeepSeek-V2, DeepSeek-V3 and GLM-4 MoE Lite."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.fx_passes.tiny_models import left_padded_batch, tiny_model

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


def _generate(model, cache):
    from mla_compile.mla_ops.hf_cache import cache_kwargs

    ids, mask = left_padded_batch((7, 11))
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
            output_logits=True, return_dict_in_generate=True, **cache_kwargs(model, cache),
        )  # fmt: skip
    return out.sequences, torch.stack(out.logits)


def _cache(model):
    from mla_compile.mla_ops.hf_cache import MLACache

    return MLACache(model.config, max_length=32, static=True, batch_size=2,
                    dtype=torch.float64, device="cpu")  # fmt: skip


def _worker(rank: int, root: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", init_method=f"file://{root}/rendezvous", rank=rank,
                            world_size=WORLD)  # fmt: skip
    try:
        from torch._dynamo.utils import counters

        for family in FAMILIES:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                f"{root}/{family}", dtype=torch.float64, experts_implementation="batched_mm",
                distributed_config=DistributedConfig(tp_plan="auto"),
            ).eval()  # fmt: skip
            weight = model.model.layers[0].self_attn.kv_b_proj.weight  # sharded by heads
            local = weight.to_local() if hasattr(weight, "to_local") else weight
            text = model.config
            rows = text.num_attention_heads * (text.qk_nope_head_dim + text.v_head_dim)
            assert local.shape[0] * WORLD == rows, (family, tuple(local.shape), rows)
            torch._dynamo.reset()
            counters.clear()
            model.forward = torch.compile(model.forward, backend="mla_eager", fullgraph=True)
            tokens, logits = _generate(model, _cache(model))
            sites = dict(counters["mla"])
            torch.save((tokens, logits, sites), f"{root}/{family}_rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_heads_match_one_process(tmp_path) -> None:
    """A failing rank's exception and traceback come back through ``mp.spawn``."""
    want = {}
    for family in FAMILIES:
        model = tiny_model(family)  # float64, 4 heads: 2 per rank
        model.save_pretrained(tmp_path / family)
        want[family] = _generate(model, None)
    mp.spawn(_worker, args=(str(tmp_path),), nprocs=WORLD)
    for family in FAMILIES:
        tokens_want, logits_want = want[family]
        for rank in range(WORLD):
            tokens, logits, sites = torch.load(tmp_path / f"{family}_rank{rank}.pt")
            assert torch.equal(tokens, tokens_want), (family, rank)
            torch.testing.assert_close(logits, logits_want, rtol=1e-10, atol=1e-10)
            # the decode step's sites read the rank's pages (the prefill's stay un-absorbed)
            assert sites.get("paged_sites", 0) >= 2, (family, rank, sites)
