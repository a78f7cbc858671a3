"""Why a rewritten model's attention can cost more than ``mla_decode`` timed alone.

``bench_e2e.py`` compares the ``mla`` kernels' CUDA time in a profiled decode step with
``mla_decode`` timed alone at the same shapes (``attention_vs_kernel_bench``). This records the
arguments the rewritten step really passes to ``mla::attention`` (one decode step of a
DeepSeek-V2-Lite-shaped model over an ``MLACache``, as ``bench_e2e`` fills it), then times
``triton_kernels.attention`` on them (graph replays, clean L2) as recorded and with one thing
changed at a time: no mask, the mask made contiguous, the plan (``num_splits``, ``total_splits``)
of the kernel benchmark, and the kernel benchmark's own inputs (one ``[pages, 64, 576]`` pool).

    python benchmarks/experiments/e2e_attention_gap.py --cases 32x32768,32x8192 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench_decode as bd
import bench_e2e as be
from v2_lite import v2_lite

from mla_ops import planner
from mla_ops import triton_kernels as tk


def describe(t) -> object:
    if not isinstance(t, torch.Tensor):
        return t
    return dict(shape=list(t.shape), stride=list(t.stride()), dtype=str(t.dtype))


def recorded_call(model, batch: int, context: int) -> tuple:
    """The arguments of the first ``triton_kernels.attention`` call of one rewritten decode step
    (the cache filled with ``context`` tokens), and what the launch recorded."""
    calls = []
    original = tk.attention

    def spy(*args):
        calls.append(args)
        return original(*args)

    capacity = context + 8
    cache = be.make_cache("mla", model, batch, capacity)
    be.fill(cache, model, batch, context)
    step = be.step_function("mla", model)
    ids = torch.randint(3, 1000, (batch, 1), device="cuda")
    tk.attention = spy
    try:
        with torch.no_grad():
            step(input_ids=ids, use_cache=True, **be.cache_kwargs(model, cache))
    finally:
        tk.attention = original
    torch.cuda.synchronize()
    if not calls:
        raise RuntimeError("the rewritten step made no mla::attention call")
    # The first layer's call; the arguments are cloned so that later steps cannot change them.
    args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in calls[0])
    return args, cache


def time_call(args) -> tuple[float, dict]:
    fn = bd.graphed(lambda: tk.attention(*args))
    tk.attention(*args)
    launch = {k: str(v) for k, v in tk.LAST_LAUNCH.items() if k != "decode"}
    return bd.time_rotating([fn], warmup=10, rep=100) * 1e6, launch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="32x32768,32x8192")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    model = v2_lite(args.layers)
    results = []
    for case in args.cases.split(","):
        batch, context = (int(x) for x in case.split("x"))
        call, cache = recorded_call(model, batch, context)
        q, kv_c, k_pe, seqlens, table, scale, causal, _splits, kv_scale, mask, total = call
        heads, kv_len = q.shape[2], kv_c.shape[-1]
        capacity = kv_c.shape[1] * table.shape[1]
        plan = planner.plan_splits(batch, heads, capacity, q.device, True)
        record = dict(
            case=case, args={n: describe(a) for n, a in zip(
                ("q", "kv_c", "k_pe", "cache_seqlens", "block_table", "softmax_scale", "causal",
                 "num_splits", "kv_scale", "attn_mask", "total_splits"), call)},
            lengths=sorted(set(seqlens.tolist())),
            bench_plan=dict(num_splits=plan.num_splits, total_splits=plan.total_splits),
        )  # fmt: skip
        variants = {"as recorded": call}
        if mask is not None:
            variants["no mask"] = (*call[:9], None, total)
            variants["mask contiguous"] = (*call[:9], mask.contiguous(), total)
        variants["bench plan"] = (*call[:7], plan.num_splits, kv_scale, mask, plan.total_splits)
        # bench_e2e's kernel benchmark: one [pages, 64, 576] pool, pages in order, no mask.
        pages = table.shape[1]
        pool = torch.randn(batch * pages, 64, kv_len + k_pe.shape[-1], device="cuda",
                           dtype=q.dtype)  # fmt: skip
        bench_table = torch.arange(batch * pages, device="cuda", dtype=torch.int32)
        bench_kv_c, bench_k_pe = pool[..., :kv_len], pool[..., kv_len:]
        variants["kernel bench inputs"] = (
            q, bench_kv_c, bench_k_pe, seqlens, bench_table.view(batch, pages), scale, causal,
            plan.num_splits, kv_scale, None, plan.total_splits,
        )  # fmt: skip
        variants["kernel bench inputs + recorded mask"] = (
            *variants["kernel bench inputs"][:9], mask, plan.total_splits,
        )  # fmt: skip
        record["us"], record["launch"] = {}, {}
        reference = None
        for name, v in variants.items():
            us, launch = time_call(v)
            record["us"][name], record["launch"][name] = us, launch
            if name in ("as recorded", "no mask"):
                out = tk.attention(*v)[0].float()
                reference = out if reference is None else reference
                record.setdefault("max_diff_vs_recorded", {})[name] = (
                    (out - reference).abs().max().item()
                )
            print(f"{case:>9} {name:<38} {us:8.1f} us  {launch.get('merge', '')[:60]}")
        results.append(record)
        del cache, pool, call, variants
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(0).replace(" ", "_")
    (out / f"e2e_attention_gap_{name}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
