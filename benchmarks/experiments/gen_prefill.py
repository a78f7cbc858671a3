"""Model-level prompt pass: V2-Lite shapes, N layers, bf16. HF eager vs mla_eager (rewrite, no
Inductor) over MLACache, with and without generate(prefill_chunk_size). TTFT and peak memory of a
generate(max_new_tokens=1) call, above what was allocated before it."""

import json
import os
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
from v2_lite import v2_lite

from mla_compile import fx_passes  # noqa: F401
from mla_compile.mla_ops.hf_cache import MLACache, cache_kwargs

layers = int(os.environ.get("LAYERS", "4"))
cases = os.environ.get("CASES", "16x8192,1x32768").split(",")
out_dir = os.environ.get("OUT", ".")
DEVICE = os.environ.get("DEVICE", "cuda")
model = v2_lite(layers, device=DEVICE)
original_forward = model.forward
rows = []
CUDA = DEVICE == "cuda"


def sync():
    if CUDA:
        torch.cuda.synchronize()


def reset():
    if CUDA:
        torch.cuda.reset_peak_memory_stats()


def alloc():
    return torch.cuda.memory_allocated() if CUDA else 0


def maxalloc():
    return torch.cuda.max_memory_allocated() if CUDA else 0


def empty():
    if CUDA:
        torch.cuda.empty_cache()


def run(name, batch, prompt, chunk):
    torch._dynamo.reset()
    model.forward = original_forward
    kwargs = {}
    if name.startswith("mla"):
        cache = MLACache(
            model.config,
            max_length=prompt + 8,
            page_size=64,
            static=True,
            batch_size=batch,
            dtype=model.dtype,
            device=DEVICE,
        )
        model.forward = torch.compile(original_forward, backend="mla_eager")
        kwargs = cache_kwargs(model, cache)
    if chunk:
        kwargs["prefill_chunk_size"] = chunk
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 1000, (batch, prompt), generator=gen).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    result = dict(variant=name, batch=batch, prompt=prompt, prefill_chunk_size=chunk)
    try:
        for attempt in range(2):
            if name.startswith("mla"):
                cache.reset()
            sync()
            reset()
            base = alloc()
            start = time.perf_counter()
            with torch.no_grad():
                out = model.generate(
                    ids,
                    attention_mask=mask,
                    max_new_tokens=1,
                    do_sample=False,
                    pad_token_id=0,
                    **kwargs,
                )
            sync()
            result.update(
                ttft_s=time.perf_counter() - start,
                peak_gib=(maxalloc() - base) / 2**30,
                token=out[:, -1].tolist()[:4],
            )
    except torch.OutOfMemoryError:
        result["error"] = "out of memory"
    rows.append(result)
    print(result, flush=True)
    kwargs.clear()
    empty()


for case in cases:
    b, s = (int(x) for x in case.split("x"))
    for name, chunk in (
        ("hf_eager", None),
        ("mla_eager", None),
        ("hf_eager", 2048),
        ("mla_eager", 2048),
    ):
        run(name, b, s, chunk)
with open(os.path.join(out_dir, "gen_prefill.json"), "w") as f:
    json.dump(
        dict(
            layers=layers,
            gpu=torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
            torch=torch.__version__,
            rows=rows,
        ),
        f,
        indent=1,
    )
