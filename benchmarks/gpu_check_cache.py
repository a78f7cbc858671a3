"""GPU check of the latent cache: a DeepSeek-V2-Lite-shaped model (random bf16 weights, a few
layers) generating with Hugging Face's default cache vs torch.compile(backend="mla") +
MLACache(static=True); tokens, decode time per token, cache bytes per token, peak memory.

Run on the device machine (the package is on PYTHONPATH, the backend is passed as a callable):

    PYTHONPATH=. python3 benchmarks/gpu_check_cache.py --out $OUT/cache.json

The same script under an older transformers (PYTHONPATH=<dir with transformers 5.14>:.) measures
the expanded-K/V default cache against the rewritten model's latent cache.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import transformers
from bench_e2e import cache_bytes  # benchmarks/ is the script's directory
from torch._dynamo.utils import counters
from v2_lite import v2_lite  # benchmarks/ is the script's directory, so on sys.path

from fx_passes.backend import mla
from mla_ops.hf_cache import LATENT_ATTENTION, MLACache, cache_kwargs, output_cache


def generate(model, ids, new_tokens: int, cache) -> tuple[float, object]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(
        ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
        return_dict_in_generate=True, pad_token_id=0, **cache_kwargs(model, cache),
    )  # fmt: skip
    torch.cuda.synchronize()
    return time.perf_counter() - start, out


def run(model, ids, new_tokens: int, cache_factory, label: str) -> dict:
    """Warm up (compiles), then time a prefill-only generation and a full one: decode time per
    step is their difference over ``new_tokens - 1`` steps. Peak memory of the full one."""
    generate(model, ids, new_tokens, cache_factory())
    prefill_time, _ = generate(model, ids, 1, cache_factory())
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    took, out = generate(model, ids, new_tokens, cache_factory())
    past = output_cache(out)
    tokens = ids.shape[0] * (ids.shape[1] + new_tokens)
    result = dict(
        label=label,
        prefill_ms=1e3 * prefill_time,
        decode_ms_per_step=1e3 * (took - prefill_time) / (new_tokens - 1),
        peak_extra_mb=(torch.cuda.max_memory_allocated() - base) / 2**20,
        cache_mb=cache_bytes(past) / 2**20,
        cache_bytes_per_token=cache_bytes(past) / tokens,
        sequences=out.sequences.cpu(),
    )
    print(
        f"{label:<44} prefill {result['prefill_ms']:7.1f} ms  decode "
        f"{result['decode_ms_per_step']:6.2f} ms/step  peak +{result['peak_extra_mb']:7.1f} MB  "
        f"cache {result['cache_mb']:6.1f} MB ({result['cache_bytes_per_token']:.0f} B/token)"
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    model = v2_lite(args.layers)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 102400, (args.batch, args.prompt), generator=gen).cuda()
    max_length = args.prompt + args.new_tokens
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, transformers "
        f"{transformers.__version__} (latent attention: {LATENT_ATTENTION}), "
        f"{args.layers} layers, batch {args.batch}, prompt {args.prompt}, +{args.new_tokens}"
    )
    results = [run(model, ids, args.new_tokens, lambda: None, "Hugging Face default cache, eager")]
    counters.clear()
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend=mla, fullgraph=False)
    results.append(
        run(
            model,
            ids,
            args.new_tokens,
            lambda: MLACache(model.config, max_length=max_length, page_size=64, static=True),
            'compile(backend="mla") + MLACache(static)',
        )
    )
    same = (results[1]["sequences"] == results[0]["sequences"]).float().mean().item()
    print(
        f"tokens equal to the default-cache run: {same:.3f}; mla counters {dict(counters['mla'])}"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                dict(
                    device=torch.cuda.get_device_name(),
                    torch=torch.__version__,
                    transformers=transformers.__version__,
                    args=vars(args),
                    token_agreement=same,
                    counters=dict(counters["mla"]),
                    runs=[{k: v for k, v in r.items() if k != "sequences"} for r in results],
                ),
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
