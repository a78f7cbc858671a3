"""End-to-end decode: a DeepSeek-V2-Lite-shaped Hugging Face model, one decode step at a given
batch and context, four ways, on one GPU.

* ``hf_eager``: Hugging Face as it is (SDPA, ``DynamicCache``);
* ``hf_compile``: Hugging Face + ``torch.compile(mode="reduce-overhead")`` with its
  ``StaticCache`` (what ``generate(cache_implementation="static", compile_config=...)`` runs);
* ``mla``: ``torch.compile(backend="mla")`` + ``MLACache(static=True)``;
* ``mla_graphs``: the same with ``mode="reduce-overhead"`` (CUDA graphs).

Method: the model has random bf16 weights and ``--layers`` layers (the first dense, the rest
MoE; per-layer figures scale). Each cache is filled with ``T`` random tokens through its own
``update`` (no prefill: the prompt pass is not what is measured), then decode steps run on it;
after warm-up (compilation), ``--steps`` steps are timed with CUDA events, median reported.
Memory: peak allocated during the timed steps above what was allocated before them, and the
cache's own bytes per token. "Fits" is derived per variant from those two measurements: a
sequence of the case's context costs its cache bytes plus its share (1/batch) of the step's
working memory (Hugging Face re-expands the whole cache every step, so its share grows with the
context), and ``fits_batch`` = the card's free memory (after the weights) / that. ``--fit``
checks the derivation by running it: at the largest context, each of ``--fit-variants`` runs at
95 % of its derived batch (expected to run) and at 110 % (expected to run out of memory).
Ratio: ``mla_graphs`` tokens/s over ``hf_compile``'s. Bound: what that ratio would be if our
attention took no time at all (``hf_compile`` step / (``mla_graphs`` step - the ``mla`` kernels'
profiled time)): the ceiling set by the rest of the model (projections, experts, head), which
both sides run alike.
Attention share: the time during which any ``mla`` kernel runs in a profiled step of ``mla`` (the
union of their intervals: the combine, launched early, overlaps the decode), against
``mla_decode`` timed alone at the same shapes (CUDA-graph replays) x layers.

    python benchmarks/bench_e2e.py        # all cases; writes e2e_*.json, .csv, .png under --out
    python benchmarks/bench_e2e.py --cases 32x8192 --variants mla,mla_graphs
    python benchmarks/bench_e2e.py --cases 32x32768 --variants hf_compile,mla,mla_graphs --fit
"""

from __future__ import annotations

import argparse
import csv
import datetime
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch
import transformers
from torch._dynamo.utils import counters
from tqdm import tqdm
from v2_lite import v2_lite  # benchmarks/ is the script's directory, so on sys.path

from mla_compile import mla_ops
from mla_compile.fx_passes.backend import mla
from mla_compile.mla_ops.hf_cache import MLACache, cache_kwargs

PROFILED_STEPS = 3  # steps the attention share averages over (after the timed ones)
VARIANTS = ("hf_eager", "hf_compile", "mla", "mla_graphs")
CASES = ("1x1024", "1x8192", "1x32768", "32x1024", "32x8192", "32x32768")


def make_cache(variant: str, model, batch: int, capacity: int):
    if variant == "hf_eager":
        return transformers.DynamicCache(config=model.config)
    if variant == "hf_compile":
        return transformers.StaticCache(config=model.config, max_cache_len=capacity)
    return MLACache(model.config, max_length=capacity, page_size=64, static=True)


def fill(cache, model, batch: int, context: int, chunk: int = 2048) -> None:
    """``context`` random tokens per sequence in every layer, through the cache's own write path,
    ``chunk`` tokens at a time (bf16 straight from the generator: no float32 copy of the cache)."""
    config = model.config
    gen = torch.Generator(device="cuda").manual_seed(0)
    for start in range(0, context, chunk):
        n = min(chunk, context - start)
        for layer in range(config.num_hidden_layers):
            kv_c = torch.randn(batch, 1, n, config.kv_lora_rank, device="cuda",
                               dtype=torch.bfloat16, generator=gen)  # fmt: skip
            k_pe = torch.randn(batch, 1, n, config.qk_rope_head_dim, device="cuda",
                               dtype=torch.bfloat16, generator=gen)  # fmt: skip
            if isinstance(cache, MLACache):
                # Straight into the pages: MLACache.update also returns the dense rows (what an
                # unrewritten model attends over), a whole-cache copy the compiled step never makes.
                paged = cache.store.get(batch, kv_c.dtype, kv_c.device)
                paged.append(layer, kv_c[:, 0], k_pe[:, 0])
            else:
                cache.update(kv_c, k_pe, layer)
            del kv_c, k_pe
    torch.cuda.empty_cache()


def cache_bytes(cache) -> int:
    """Bytes the cache's tensors occupy now (an MLACache: its pools and block table, or the
    expanded K/V an unrewritten model handed it)."""
    if isinstance(cache, MLACache):
        if cache.paged is None:
            return sum(t.nbytes for layer in cache.layers for t in layer.expanded)
        return sum(p.nbytes for p in cache.paged.pools) + cache.paged.block_table.nbytes
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def step_function(variant: str, model):
    if variant == "hf_eager":
        return model.forward
    if variant == "hf_compile":
        return torch.compile(model.forward, mode="reduce-overhead", fullgraph=False)
    mode = "reduce-overhead" if variant == "mla_graphs" else None
    return torch.compile(model.forward, backend=functools.partial(mla, mode=mode))


def run_capacity(context: int, args) -> int:
    """Tokens per sequence a run's cache holds: the context plus every step taken on it."""
    return context + args.warmup + args.steps + PROFILED_STEPS


def measure(variant: str, model, batch: int, context: int, args) -> dict:
    torch._dynamo.reset()
    counters.clear()
    capacity = run_capacity(context, args)
    cache = make_cache(variant, model, batch, capacity)
    fill(cache, model, batch, context)
    step = step_function(variant, model)
    ids = torch.randint(3, 1000, (batch, 1), device="cuda")
    times = []
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        for i in range(args.warmup + args.steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            logits = step(input_ids=ids, use_cache=True, **cache_kwargs(model, cache)).logits
            end.record()
            ids = logits[:, -1:].argmax(-1)
            if i >= args.warmup:
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
    step_ms = statistics.median(times)
    cached_tokens = batch * capacity
    result = dict(
        variant=variant,
        batch=batch,
        context=context,
        layers=model.config.num_hidden_layers,
        step_ms=step_ms,
        tokens_per_s=batch / step_ms * 1e3,
        peak_step_mb=(torch.cuda.max_memory_allocated() - base) / 2**20,
        cache_bytes_per_token=cache_bytes(cache) / cached_tokens,
        mla_sites=dict(counters["mla"]),
    )
    if variant == "mla":
        result.update(attention_share(step, model, cache, ids, batch, context))
    del cache, step
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return result


def busy_us(events) -> float:
    """Microseconds during which at least one of the profiler's kernel ``events`` ran."""
    busy, end = 0.0, float("-inf")
    for e in sorted(events, key=lambda e: e.time_range.start):
        start = max(e.time_range.start, end)
        if e.time_range.end > start:
            busy += e.time_range.end - start
        end = max(end, e.time_range.end)
    return busy


def attention_share(step, model, cache, ids, batch: int, context: int) -> dict:
    """CUDA time of the mla kernels per step (mean over ``PROFILED_STEPS`` profiled steps) vs
    ``mla_decode`` alone at the same shapes."""
    import triton

    with (
        torch.no_grad(),
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof,
    ):
        for _ in range(PROFILED_STEPS):
            step(input_ids=ids, use_cache=True, **cache_kwargs(model, cache))
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.device_time for e in events) / PROFILED_STEPS
    # Decode + combine kernels: the time any of them runs (the union of their intervals), not
    # the sum of their durations, since the combine is launched early (programmatic dependent
    # launch) and its interval covers the decode's last part while it waits. The sum counted
    # that overlap twice: 1.42x the kernel timed alone at 32 x 32k, against 1.00x for the union
    # .
    mla_events = [e for e in events if "_mla_" in e.name]
    attention = busy_us(mla_events) / PROFILED_STEPS
    attention_sum = sum(e.device_time for e in mla_events) / PROFILED_STEPS
    config = model.config
    heads, kv_len, rope = config.num_attention_heads, config.kv_lora_rank, config.qk_rope_head_dim
    pages = -(-(context + 1) // 64)
    q = torch.randn(batch, 1, heads, kv_len + rope, device="cuda", dtype=torch.bfloat16)
    pool = torch.randn(batch * pages, 64, kv_len + rope, device="cuda", dtype=torch.bfloat16)
    table = torch.arange(batch * pages, device="cuda", dtype=torch.int32).view(batch, pages)
    lengths = torch.full((batch,), context + 1, device="cuda", dtype=torch.int32)
    alone_ms = triton.testing.do_bench_cudagraph(  # replays: no launch overhead, as in the step
        lambda: mla_ops.mla_decode(
            q, pool, lengths, block_table=table, head_dim_v=kv_len, softmax_scale=0.1, causal=False
        )
    )
    predicted_us = alone_ms * 1e3 * config.num_hidden_layers
    return dict(
        attention_us=attention,
        attention_kernels_sum_us=attention_sum,
        step_device_us=total,
        attention_share=attention / total if total else None,
        kernel_bench_us=predicted_us,
        attention_vs_kernel_bench=attention / predicted_us if predicted_us else None,
    )


def run_case(variant: str, model, batch: int, context: int, args, free: int) -> dict:
    """``measure`` with failures reported as rows (out of memory included), and the derived fit."""
    try:
        result = measure(variant, model, batch, context, args)
    except torch.OutOfMemoryError as error:
        result = dict(variant=variant, batch=batch, context=context, error=f"OOM: {error}"[:200])
    except Exception as error:  # reported, not hidden: the table says it failed
        result = dict(variant=variant, batch=batch, context=context,
                      error=f"{type(error).__name__}: {error}"[:300])  # fmt: skip
    if "error" in result:  # what the failed step held goes back before the next case
        release_memory()
        return result
    per_sequence = (
        result["cache_bytes_per_token"] * run_capacity(context, args)
        + result["peak_step_mb"] * 2**20 / batch
    )
    result["fits_batch"] = int(free // per_sequence)
    result["fits_tokens"] = result["fits_batch"] * context
    return result


def summary(results: list[dict], cases) -> list[dict]:
    """Per case: ours (CUDA graphs) over Hugging Face + torch.compile, and that ratio's ceiling
    if our attention cost nothing (see the module docstring)."""
    rows = []
    for batch, context in cases:
        row = {r["variant"]: r for r in results if (r["batch"], r["context"]) == (batch, context)}
        hf, ours, profiled = (row.get(v, {}) for v in ("hf_compile", "mla_graphs", "mla"))
        if "step_ms" not in hf or "step_ms" not in ours:
            continue
        entry = dict(batch=batch, context=context, ratio=hf["step_ms"] / ours["step_ms"])
        if "attention_us" in profiled:
            rest_ms = ours["step_ms"] - profiled["attention_us"] / 1e3
            entry["ratio_if_attention_free"] = hf["step_ms"] / rest_ms
        rows.append(entry)
    return rows


def release_memory() -> None:
    """Give back what compiled graphs, CUDA-graph pools and dead caches hold."""
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()


def fit_check(results: list[dict], args) -> list[dict]:
    """Run the derived largest batch at the largest context, each in a fresh process (a failed
    attempt's memory cannot leak into the next): 95 % should run, 110 % should not."""
    context = max(r["context"] for r in results)
    free_now, total = torch.cuda.mem_get_info()  # what this process still holds, for the record
    checks = []
    for variant in args.fit_variants.split(","):
        derived = [r for r in results if r["variant"] == variant and r["context"] == context
                   and "fits_batch" in r]  # fmt: skip
        if not derived:
            continue
        predicted = max(derived, key=lambda r: r["batch"])["fits_batch"]
        for fraction in (0.95, 1.10):
            batch = max(1, round(predicted * fraction))
            tqdm.write(f"fit check: {variant} {batch} x {context} (derived limit {predicted})")
            with tempfile.TemporaryDirectory() as out:
                command = [sys.executable, __file__, "--cases", f"{batch}x{context}",
                           "--variants", variant, "--layers", str(args.layers), "--warmup", "2",
                           "--steps", "3", "--no-plot", "--out", out]  # fmt: skip
                child = subprocess.run(command, capture_output=True, text=True)
                files = [f for f in os.listdir(out) if f.endswith(".json")]
                if files:
                    with open(os.path.join(out, files[0])) as f:
                        run = json.load(f)
                    result, child_free_mb = run["results"][0], run["meta"]["free_mb"]
                else:  # the child died before writing: keep its last words
                    result = dict(error=(child.stdout + child.stderr)[-300:])
                    child_free_mb = None
            checks.append(dict(variant=variant, context=context, derived_batch=predicted,
                               batch=batch, ran="step_ms" in result, step_ms=result.get("step_ms"),
                               error=result.get("error"), free_mb_in_run=child_free_mb,
                               held_by_parent_mb=(total - free_now) / 2**20))  # fmt: skip
            tqdm.write(json.dumps(checks[-1]))
    return checks


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--cases", default=",".join(CASES), help="batch x context, comma-separated")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--fit", action="store_true", help="run the derived largest batches")
    parser.add_argument("--fit-variants", default="hf_compile,mla_graphs")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()

    model = v2_lite(args.layers)
    weights_mb = sum(p.nbytes for p in model.parameters()) / 2**20
    free, _ = torch.cuda.mem_get_info()
    device = torch.cuda.get_device_name()
    print(f"{device}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"V2-Lite shapes x {args.layers} layers ({weights_mb:.0f} MB of weights)")  # fmt: skip
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
    variants = args.variants.split(",")
    results = []
    for (batch, context), variant in tqdm([(c, v) for c in cases for v in variants], desc="run"):
        results.append(run_case(variant, model, batch, context, args, free))
        tqdm.write(json.dumps({k: v for k, v in results[-1].items() if k != "mla_sites"}))
    ratios = summary(results, cases)
    del model
    release_memory()
    checks = fit_check(results, args) if args.fit else []

    stamp = datetime.date.today().isoformat()
    name = os.path.join(args.out, f"e2e_{device.replace(' ', '_')}_{stamp}")
    meta = dict(device=device, torch=torch.__version__, transformers=transformers.__version__,
                layers=args.layers, weights_mb=weights_mb, free_mb=free / 2**20,
                date=stamp)  # fmt: skip
    with open(name + ".json", "w") as f:
        json.dump(dict(meta=meta, results=results, summary=ratios, fit_check=checks), f, indent=1)
    keys = ["variant", "batch", "context", "step_ms", "tokens_per_s", "peak_step_mb",
            "cache_bytes_per_token", "fits_batch", "fits_tokens", "attention_share",
            "attention_vs_kernel_bench", "error"]  # fmt: skip
    with open(name + ".csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(results)
    print(f"\n{'case':>9} " + " ".join(f"{v:>11}" for v in variants) + "  ratio  bound")
    for batch, context in cases:
        row = {r["variant"]: r for r in results if (r["batch"], r["context"]) == (batch, context)}
        cells = [f"{row[v]['tokens_per_s']:11.1f}" if "tokens_per_s" in row.get(v, {}) else
                 f"{'failed':>11}" for v in variants]  # fmt: skip
        ratio = next((r for r in ratios if (r["batch"], r["context"]) == (batch, context)), {})
        tail = f"{ratio['ratio']:6.2f}x" if "ratio" in ratio else "      -"
        tail += (
            f" {ratio['ratio_if_attention_free']:5.2f}x"
            if "ratio_if_attention_free" in ratio
            else ""
        )
        print(f"{batch:>3}x{context:<5} " + " ".join(cells) + " " + tail)
    print("(tokens/s; ratio = mla_graphs / hf_compile; bound = that ratio with free attention)")
    for check in checks:
        outcome = "ran" if check["ran"] else check["error"]
        print(f"fit: {check['variant']} {check['batch']} x {check['context']} "
              f"(derived {check['derived_batch']}): {outcome}")  # fmt: skip
    if not args.no_plot:
        plot(results, cases, variants, name + ".png", meta)


def plot(results, cases, variants, path, meta) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(variants)
    for i, variant in enumerate(variants):
        values = []
        for batch, context in cases:
            match = [r for r in results if (r["variant"], r["batch"], r["context"]) ==
                     (variant, batch, context) and "tokens_per_s" in r]  # fmt: skip
            values.append(match[0]["tokens_per_s"] if match else 0)
        ax.bar([j + i * width for j in range(len(cases))], values, width, label=variant)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))])
    ax.set_xticklabels([f"B={b}\nT={t}" for b, t in cases])
    ax.set_ylabel("decode tokens/s")
    ax.set_yscale("log")
    ax.set_title(f"{meta['device']}, V2-Lite shapes x {meta['layers']} layers, bf16")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
