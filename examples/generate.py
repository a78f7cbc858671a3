"""Generate with a Hugging Face MLA model three ways, and see what the one line buys.

1. ``original``: the model as transformers builds it, with its default cache.
2. ``hf static+compile``: Hugging Face's own fast path, a static cache and ``torch.compile``.
3. ``backend="mla"``: ``torch.compile(model.forward, backend="mla")`` and an ``MLACache`` (one
   latent row per token per layer, read in place by the ``mla_decode`` kernel).

Printed: the tokens of each (they must be identical), decode tokens/s, the cache's bytes per token
and the K/V each decode step expands per layer (the original re-expands every cached token from
the latent at every step; the rewrite reads the latent as it is). On CUDA also the peak memory
of each ``generate()`` call above the weights.

By default the model is a small DeepSeek-V3-shaped one with random weights (no download):

    python examples/generate.py                                  # CPU, float32
    python examples/generate.py --device cuda --dtype bfloat16 --batch-size 8 --max-new-tokens 256
    python examples/generate.py --model /path/to/local/checkpoint --prompt "The capital of"
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import transformers
from tqdm import tqdm

from mla_compile import fx_passes  # noqa: F401  (backend="mla" also without pip install)
from mla_compile.mla_ops.hf_cache import LATENT_ATTENTION, MLACache, cache_kwargs, output_cache

WAYS = ("original", "hf-static", "mla")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--model",
        default=None,
        help="local checkpoint directory or hub id (default: built-in, random)",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=16, help="random prompt tokens (no --prompt)")
    p.add_argument("--prompt", default=None, help="prompt text (needs the checkpoint's tokenizer)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument(
        "--backend",
        default="mla",
        choices=["mla", "mla_eager"],
        help="mla: rewrite + Inductor; mla_eager: rewrite only",
    )
    p.add_argument(
        "--ways",
        default=",".join(WAYS),
        help=f"which of {','.join(WAYS)} to run (the original always runs)",
    )
    return p.parse_args()  # fmt: skip


def built_in_model(dtype: torch.dtype) -> torch.nn.Module:
    """DeepSeek-V3's layout (q_lora, MLA with L=128, R=32, P=64, V=64, MoE) at a small width,
    built the way transformers builds it by default."""
    config = transformers.DeepseekV3Config(
        vocab_size=4096, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, n_routed_experts=16,
        n_group=4, topk_group=2, num_experts_per_tok=4, first_k_dense_replace=1,
        kv_lora_rank=128, q_lora_rank=192, qk_nope_head_dim=64, qk_rope_head_dim=32,
        v_head_dim=64, max_position_embeddings=4096,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.DeepseekV3ForCausalLM._from_config(config, dtype=dtype)


def load_model(args, dtype: torch.dtype):
    """The model and its tokenizer (None for the built-in model)."""
    if args.model is None:
        return built_in_model(dtype), None
    looks_local = os.path.isabs(args.model) or args.model.startswith((".", "~"))
    if looks_local and not os.path.isdir(os.path.expanduser(args.model)):
        raise SystemExit(f"--model {args.model}: no such directory (a local checkpoint folder)")
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    return model, transformers.AutoTokenizer.from_pretrained(args.model)


def prompts(args, model, tokenizer) -> dict:
    """``input_ids`` / ``attention_mask`` ``[B, S]`` (left-padded when the texts differ)."""
    if args.prompt is not None:
        if tokenizer is None:
            raise SystemExit("--prompt needs a checkpoint with a tokenizer (--model)")
        tokenizer.padding_side = "left"
        batch = tokenizer([args.prompt] * args.batch_size, return_tensors="pt", padding=True)
        return {k: v.to(args.device) for k, v in batch.items()}
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(
        3, model.config.vocab_size, (args.batch_size, args.prompt_len), generator=gen
    )
    return {
        "input_ids": ids.to(args.device),
        "attention_mask": torch.ones_like(ids).to(args.device),
    }


class Progress(transformers.StoppingCriteria):
    """A progress bar over the generated tokens, all sequences counted (a stopping criterion
    that never stops: called once per generated position)."""

    def __init__(self, total: int, label: str) -> None:
        self.bar = tqdm(total=total, desc=label, unit="tok", leave=False)

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        self.bar.update(input_ids.shape[0])
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def generate(model, batch: dict, args, label: str, **kwargs) -> tuple[torch.Tensor, float, object]:
    """Greedy generation of exactly ``max_new_tokens``: tokens, seconds, the cache."""
    progress = Progress(args.batch_size * args.max_new_tokens, label)
    if args.device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(
        **batch, max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens,
        do_sample=False, return_dict_in_generate=True,
        stopping_criteria=transformers.StoppingCriteriaList([progress]),
        pad_token_id=model.generation_config.pad_token_id or 0, **kwargs,
    )  # fmt: skip
    if args.device == "cuda":
        torch.cuda.synchronize()
    progress.bar.close()
    return out.sequences, time.perf_counter() - start, output_cache(out)


def decode_rate(model, batch: dict, args, label: str, call_kwargs=dict):
    """Tokens, decode tokens/s and peak bytes (CUDA) of one ``generate()``: decode time is the
    whole call's minus a 1-token call's (the prompt pass), so the prefill does not count.
    ``call_kwargs()`` gives each call's extra arguments (a fresh or reset cache)."""
    one = argparse.Namespace(**{**vars(args), "max_new_tokens": 1})
    # The whole generation once first: a compiled forward compiles its prefill and decode graphs
    # here, recompiles included (Inductor's may recompile a few steps in), not in the timed calls.
    generate(model, batch, args, f"{label} (warm-up, compiles)", **call_kwargs())
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    _, prefill, _ = generate(model, batch, one, f"{label} (prefill)", **call_kwargs())
    tokens, took, cache = generate(model, batch, args, label, **call_kwargs())
    peak = torch.cuda.max_memory_allocated() - base if args.device == "cuda" else None
    rate = args.batch_size * (args.max_new_tokens - 1) / max(took - prefill, 1e-9)
    return tokens, rate, cache, peak


def cache_bytes_per_token(cache, batch: int) -> float:
    """Bytes the cache holds per token slot (all layers): latents, or keys and values."""
    if isinstance(cache, MLACache):
        return float(cache.bytes_per_token())
    total = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    return total / (cache.layers[0].keys.shape[-2] * batch)


def expanded_per_step(config, batch: int, context: int, element_size: int) -> int:
    """Bytes of the per-head keys and values one layer's decode step builds over ``context``
    cached tokens: ``B x T x H x (P + R + V)`` elements."""
    text = config.get_text_config()
    width = text.qk_nope_head_dim + text.qk_rope_head_dim + text.v_head_dim
    return batch * context * text.num_attention_heads * width * element_size


def main() -> None:
    args = parse_args()
    ways = [w for w in args.ways.split(",") if w]
    if unknown := set(ways) - set(WAYS):
        raise SystemExit(f"--ways: unknown {sorted(unknown)}; choose from {WAYS}")
    dtype = getattr(torch, args.dtype)
    model, tokenizer = load_model(args, dtype)
    model = model.to(args.device).eval()
    batch = prompts(args, model, tokenizer)  # input_ids [B, S], attention_mask [B, S]
    prompt_len = batch["input_ids"].shape[1]
    length = prompt_len + args.max_new_tokens
    original_forward = model.forward
    rows = {}  # way: (tokens, tokens/s, cache bytes/token, expanded bytes/step, peak bytes)

    # 1. the model as it is, with its default cache
    tokens, rate, cache, peak = decode_rate(model, batch, args, "original")
    # transformers >= 5.15 caches the latent and re-expands it at every step; earlier releases
    # cache the expanded K/V themselves (the cache bytes show it)
    expanded = (
        expanded_per_step(model.config, args.batch_size, length - 1, dtype.itemsize)
        if LATENT_ATTENTION
        else 0
    )
    rows["original"] = (tokens, rate, cache_bytes_per_token(cache, args.batch_size), expanded, peak)

    # 2. Hugging Face's fast path: its static cache, the forward compiled by Inductor
    if "hf-static" in ways:
        torch._dynamo.reset()
        model.forward = torch.compile(original_forward)
        tokens, rate, cache, peak = decode_rate(
            model, batch, args, "hf static+compile",
            lambda: {"cache_implementation": "static"},
        )  # fmt: skip
        rows["hf static+compile"] = (
            tokens, rate, cache_bytes_per_token(cache, args.batch_size), expanded, peak
        )  # fmt: skip

    # 3. one line: compile with the MLA rewrite, into a latent cache
    if "mla" in ways:
        torch._dynamo.reset()
        model.forward = torch.compile(original_forward, backend=args.backend)
        cache = MLACache(
            model.config, max_length=length, page_size=args.page_size, static=True,
            batch_size=args.batch_size, dtype=dtype, device=args.device,
        )  # fmt: skip

        def reset_cache() -> dict:  # every call starts from a new prompt: reset() first
            cache.reset()
            return cache_kwargs(model, cache)  # `cache=` (>= 5.24) or `past_key_values=`

        tokens, rate, _, peak = decode_rate(model, batch, args, 'backend="mla"', reset_cache)
        rows['backend="mla"'] = (tokens, rate, float(cache.bytes_per_token()), 0, peak)

    report(args, rows, prompt_len, tokenizer)


def report(args, rows: dict, prompt_len: int, tokenizer) -> None:
    want = rows["original"][0]
    print(f"model: {args.model or 'built-in DeepSeek-V3-shaped, random weights'}, "
          f"{args.device}, {args.dtype}, batch {args.batch_size}, prompt {prompt_len}, "
          f"{args.max_new_tokens} new tokens")  # fmt: skip
    for name, (tokens, *_) in rows.items():
        new = tokens[0, prompt_len:].tolist()
        text = tokenizer.decode(new) if tokenizer is not None else new[:12]
        print(f"{name:>18}: {text}{' ...' if tokenizer is None and len(new) > 12 else ''}")
    same = {name: (row[0] == want).float().mean().item() for name, row in rows.items()}
    differ = {n: s for n, s in same.items() if s < 1.0}
    equal = ", ".join(f"{n} {100 * s:.1f} % of tokens equal" for n, s in differ.items())
    print(f"outputs: {equal or 'identical'}")
    peak_head = f"  {'peak MB':>8}" if args.device == "cuda" else ""
    print(f"{'':>18}  {'decode tok/s':>12}  {'cache bytes/token':>17}  "
          f"{'K/V expanded per layer-step':>27}{peak_head}")  # fmt: skip
    for name, (_, rate, per_token, expanded, peak) in rows.items():
        step = f"{expanded / 2**20:.2f} MiB" if expanded else "none"
        peak_cell = f"  {peak / 2**20:8.1f}" if peak is not None else ""
        print(f"{name:>18}  {rate:12.1f}  {per_token:17.0f}  {step:>27}{peak_cell}")


if __name__ == "__main__":
    main()
