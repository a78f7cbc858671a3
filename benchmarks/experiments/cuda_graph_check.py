"""The one-line change with CUDA graphs: prompt pass (mla::prefill) and decode both compiled by
torch.compile(model.forward, backend="mla", mode="reduce-overhead") over an up-front MLACache;
tokens against the uncompiled model, three generate() calls; also prefill_chunk_size."""

import sys
import time

import torch

sys.path.insert(0, "benchmarks")
from v2_lite import v2_lite

from mla_compile import fx_passes  # noqa: F401
from mla_compile.mla_ops import prefill as prefill_op
from mla_compile.mla_ops.hf_cache import MLACache, cache_kwargs

model = v2_lite(2)
gen = torch.Generator().manual_seed(0)
ids = torch.randint(3, 1000, (2, 300), generator=gen).cuda()
mask = torch.ones_like(ids)
mask[0, :5] = 0
args = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
with torch.no_grad():
    want = model.generate(ids, **args)
for chunk in (None, 128):
    torch._dynamo.reset()
    cache = MLACache(
        model.config,
        max_length=512,
        page_size=64,
        static=True,
        batch_size=2,
        dtype=model.dtype,
        device="cuda",
    )
    forward = model.forward
    model.forward = torch.compile(forward, backend="mla", mode="reduce-overhead")
    extra = {} if chunk is None else dict(prefill_chunk_size=chunk)
    for call in range(3):
        cache.reset()
        start = time.perf_counter()
        with torch.no_grad():
            got = model.generate(ids, **args, **extra, **cache_kwargs(model, cache))
        torch.cuda.synchronize()
        same = (got == want).float().mean().item()
        plan = prefill_op.LAST_PLAN.get("prefill")
        print(
            f"chunk={chunk} call {call}: {time.perf_counter() - start:.2f} s, token agreement "
            f"{same:.3f}, last prefill plan: {plan and plan.describe().splitlines()[0]}",
            flush=True,
        )
    model.forward = forward
