"""What users run: ``generate()`` of a DeepSeek-V2-Lite-shaped model built the default way, four
ways, on one GPU (or, at toy sizes, on CPU to check the script).

* ``hf_eager``: Hugging Face as it is (SDPA, ``DynamicCache``);
* ``hf_static``: ``generate(cache_implementation="static", compile_config=CompileConfig(
  mode="reduce-overhead"))``, Hugging Face's own compile path (decode steps compiled);
* ``mla_config``: the same path with ``CompileConfig(backend="mla")`` and ``MLACache``;
* ``mla_line``: the one-line change, ``model.forward = torch.compile(model.forward,
  backend="mla", mode="reduce-overhead")`` (prompt pass compiled too) with ``MLACache``.

``--prefill-chunk N`` passes ``generate(prefill_chunk_size=N)`` to every variant (Hugging Face's
chunked prompt pass: each piece of N tokens is one forward call).

Per case (batch x prompt tokens): decode tokens/s from two ``generate()`` lengths, so that the
prompt pass cancels (``B x (n2 - n1) / (t2 - t1)``); time to first token (a 1-token
``generate()``); peak memory of the whole ``n2`` call above what was allocated before it, and
``call_bytes``: that peak plus the cache (everything the call needs beyond the weights). Each
variant's first calls (compiles) are not timed. Every cache is allocated up front for the
longest call. Results: JSON and CSV under ``--out``, with the device and versions.

``--fit`` (GPU): the largest batch at each case's prompt length that the card holds, derived
from the measurement (``batch x memory the allocator can hold beyond the weights /
call_bytes``: the cache and the call's working memory grow with the batch), then run: one
``generate()`` of ``n2`` tokens at 95 % and at 110 % of it, each in a fresh process (the variant
as above, compiles included), which either runs or runs out of memory.

    python benchmarks/bench_generate.py --out results                   # every case, GPU
    python benchmarks/bench_generate.py --cases 16x8192 --variants hf_static,mla_config
    python benchmarks/bench_generate.py --device cpu --layers 2 --toy --cases 1x32 --new 4,8
    python benchmarks/bench_generate.py --cases 16x32768 --variants hf_static,mla_line --fit
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time

import torch
import transformers
from v2_lite import V2_LITE  # benchmarks/ is the script's directory, so on sys.path

from mla_compile import fx_passes  # noqa: F401  (registers backend="mla" without an install)
from mla_compile.mla_ops.hf_cache import MLACache, cache_kwargs

VARIANTS = ("hf_eager", "hf_static", "mla_config", "mla_line")
CASES = ("1x1024", "1x8192", "1x32768", "16x1024", "16x8192", "16x32768")
# A toy model with V2-Lite's layout, for checking the script on CPU.
TOY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
    num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=32,
    q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    max_position_embeddings=65536,
)  # fmt: skip


def build(args) -> torch.nn.Module:
    """The model as transformers builds it by default (its experts' implementation included)."""
    shapes = TOY if args.toy else V2_LITE
    config = transformers.DeepseekV2Config(**shapes, num_hidden_layers=args.layers)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = transformers.DeepseekV2ForCausalLM._from_config(config, dtype=args.dtype)
    return model.eval()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Variant:
    """One way of running ``generate()``: its extra arguments per call, a fresh cache each."""

    def __init__(
        self, name: str, model, batch: int, capacity: int, dtype, device, prefill_chunk=None
    ) -> None:
        self.name, self.model, self.prefill_chunk = name, model, prefill_chunk
        self.cache = None
        if name.startswith("mla"):
            self.cache = MLACache(
                model.config, max_length=capacity, page_size=64, static=True,
                batch_size=batch, dtype=dtype, device=device,
            )  # fmt: skip
        if name == "mla_line":
            model.forward = torch.compile(model.forward, backend="mla", mode="reduce-overhead")

    def kwargs(self) -> dict:
        extra = {} if self.prefill_chunk is None else dict(prefill_chunk_size=self.prefill_chunk)
        if self.name == "hf_eager":
            return extra
        if self.name == "hf_static":
            config = transformers.CompileConfig(mode="reduce-overhead")
            return dict(cache_implementation="static", compile_config=config, **extra)
        self.cache.reset()  # the storage stays: no new graph
        extra.update(cache_kwargs(self.model, self.cache))
        if self.name == "mla_config":
            extra["compile_config"] = transformers.CompileConfig(
                backend="mla", mode="reduce-overhead"
            )
        return extra

    def close(self) -> None:
        if self.name == "mla_line":
            del self.model.forward  # the instance attribute: the class's forward again


def timed_generate(model, variant: Variant, ids, mask, new: int, device: str) -> float:
    sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
            do_sample=False, pad_token_id=0, **variant.kwargs(),
        )  # fmt: skip
    sync(device)
    return time.perf_counter() - start


def inputs(model, batch: int, prompt: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompt ``[batch, prompt]`` (seeded by the case) and its all-ones mask."""
    gen = torch.Generator().manual_seed(batch * 7919 + prompt)
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt), generator=gen).to(device)
    return ids, torch.ones_like(ids)


def measure(model, name: str, batch: int, prompt: int, args) -> dict:
    torch._dynamo.reset()
    n1, n2 = args.new
    capacity = prompt + n2
    variant = Variant(name, model, batch, capacity, args.dtype, args.device, args.prefill_chunk)
    ids, mask = inputs(model, batch, prompt, args.device)
    try:
        for new in (1, n1, n2):  # compiles (recompiles included) before anything is timed
            timed_generate(model, variant, ids, mask, new, args.device)
        first = timed_generate(model, variant, ids, mask, 1, args.device)
        t1 = timed_generate(model, variant, ids, mask, n1, args.device)
        peak = call_bytes = None
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t2 = timed_generate(model, variant, ids, mask, n2, args.device)
        if args.device == "cuda":
            peak = torch.cuda.max_memory_allocated() - base
            # the cache (allocated before the call, kept between calls) and the call's peak
            call_bytes = base - args.weights_bytes + peak
        # None where the longer call was not slower (timing noise at toy sizes: raise --new).
        rate = batch * (n2 - n1) / (t2 - t1) if t2 > t1 else None
        return dict(
            variant=name, batch=batch, prompt=prompt, ttft_s=first, t1_s=t1, t2_s=t2,
            decode_tok_s=rate, peak_bytes=peak, call_bytes=call_bytes,
        )  # fmt: skip
    except torch.OutOfMemoryError:
        return dict(variant=name, batch=batch, prompt=prompt, error="out of memory")
    finally:
        variant.close()
        del variant
        if args.device == "cuda":
            torch.cuda.empty_cache()


def fit_check(model, args) -> dict:
    """``--fit-check``: one ``generate()`` of ``n2`` tokens of the one case and variant given
    (compiles included), in this fresh process: ran, or ran out of memory."""
    ((batch, prompt),) = args.case_list
    (name,) = args.variant_list
    n2 = args.new[1]
    variant = Variant(name, model, batch, prompt + n2, args.dtype, args.device, args.prefill_chunk)
    ids, mask = inputs(model, batch, prompt, args.device)
    try:
        seconds = timed_generate(model, variant, ids, mask, n2, args.device)
    except torch.OutOfMemoryError:
        return dict(batch=batch, ran=False, error="out of memory")
    return dict(batch=batch, ran=True, seconds=seconds)


def fit(row: dict, args) -> dict:
    """The largest batch the card holds at ``row``'s prompt length, derived from its
    ``call_bytes``, and the two runs that check it (fresh processes, 95 % and 110 %)."""
    per_sequence = row["call_bytes"] / row["batch"]
    derived = int(args.fit_bytes // per_sequence)
    result = dict(fit_bytes=args.fit_bytes, bytes_per_sequence=per_sequence, derived=derived)
    for share in (0.95, 1.10):
        batch = max(1, math.floor(derived * share) if share < 1 else math.ceil(derived * share))
        command = [
            sys.executable, __file__, "--fit-check", "--cases", f"{batch}x{row['prompt']}",
            "--variants", row["variant"], "--layers", str(args.layers),
            "--new", f"{args.new[0]},{args.new[1]}", "--device", args.device,
            "--dtype", str(args.dtype).removeprefix("torch."),
        ]  # fmt: skip
        if args.toy:
            command.append("--toy")
        if args.prefill_chunk is not None:
            command += ["--prefill-chunk", str(args.prefill_chunk)]
        done = subprocess.run(command, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode == 0 and lines:
            check = json.loads(lines[-1])
        else:  # a crash is not an answer: say so, with the end of what it printed
            check = dict(batch=batch, ran=None, error=(done.stderr or done.stdout)[-800:])
        result[f"at_{round(share * 100)}"] = check
        print(row["variant"], row["prompt"], f"{round(share * 100)} %:", check, flush=True)
    return result


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES), help="batch x prompt tokens")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--layers", type=int, default=27, help="V2-Lite has 27")
    p.add_argument("--new", default="16,64", help="the two generate() lengths (new tokens)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--toy", action="store_true", help="a toy model of the same layout")
    p.add_argument(
        "--prefill-chunk", type=int, default=None,
        help="generate(prefill_chunk_size=N) for every variant: the prompt in pieces of N tokens",
    )  # fmt: skip
    p.add_argument(
        "--fit", action="store_true",
        help="after measuring, derive and run the largest batch at each case's prompt (GPU)",
    )  # fmt: skip
    p.add_argument(
        "--fit-bytes", type=float, default=None,
        help="memory the calls may use beyond the weights (default: what the card's allocator "
        "can still hold once the model is built)",
    )  # fmt: skip
    p.add_argument("--fit-check", action="store_true", help=argparse.SUPPRESS)  # --fit's runs
    p.add_argument("--out", default=".")
    args = p.parse_args()
    args.dtype = getattr(torch, args.dtype)
    args.new = tuple(int(n) for n in args.new.split(","))
    if len(args.new) != 2 or not 1 <= args.new[0] < args.new[1]:
        p.error(f"--new takes two lengths n1 < n2, got {args.new}")
    args.case_list = [tuple(int(x) for x in case.split("x")) for case in args.cases.split(",")]
    args.variant_list = args.variants.split(",")
    for name in args.variant_list:
        if name not in VARIANTS:
            p.error(f"unknown variant {name!r}; choose from {VARIANTS}")
    if args.fit_check and (len(args.case_list), len(args.variant_list)) != (1, 1):
        p.error("--fit-check runs one case of one variant")
    if args.fit and args.device != "cuda" and args.fit_bytes is None:
        p.error("--fit derives from the GPU's memory: on another device give --fit-bytes")
    return args


def main() -> None:
    args = parse_args()
    model = build(args)
    if args.fit_check:
        print(json.dumps(fit_check(model, args)), flush=True)
        return
    args.weights_bytes = torch.cuda.memory_allocated() if args.device == "cuda" else 0
    if args.fit and args.fit_bytes is None:
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info()
        # what the allocator can still get: the free memory and what it holds unallocated
        args.fit_bytes = free + torch.cuda.memory_reserved() - args.weights_bytes
    rows = []
    for batch, prompt in args.case_list:
        for name in args.variant_list:
            rows.append(measure(model, name, batch, prompt, args))
            print(rows[-1], flush=True)
            if args.fit and rows[-1].get("call_bytes"):
                rows[-1]["fit"] = fit(rows[-1], args)
    facts = dict(
        date=datetime.date.today().isoformat(), device=args.device,
        gpu=torch.cuda.get_device_name() if args.device == "cuda" else platform.processor(),
        torch=torch.__version__, transformers=transformers.__version__, layers=args.layers,
        dtype=str(args.dtype), toy=args.toy, new_tokens=args.new,
        prefill_chunk_size=args.prefill_chunk, fit_bytes=args.fit_bytes,
    )  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "generate.json"), "w") as f:
        json.dump(dict(facts=facts, rows=rows), f, indent=1)
    with open(os.path.join(args.out, "generate.csv"), "w", newline="") as f:
        fields = ["variant", "batch", "prompt", "ttft_s", "t1_s", "t2_s", "decode_tok_s",
                  "peak_bytes", "call_bytes", "error", "fit"]  # fmt: skip
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
