"""Generate with a Hugging Face MLA model, as it is and with one line changed.

The original model generates with its default cache; then the same model wrapped with
``torch.compile(model.forward, backend="mla")`` generates into an ``MLACache`` (one latent row per
token per layer, read in place by the ``mla_decode`` kernel). Both outputs, tokens/s and the
cache bytes per token are printed.

By default the model is a small DeepSeek-V3-shaped one with random weights (no download):

    python examples/generate.py                                  # CPU, float32
    python examples/generate.py --device cuda --dtype bfloat16 --batch-size 8 --max-new-tokens 256
    python examples/generate.py --model /path/to/local/checkpoint --prompt "The capital of"
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers
from tqdm import tqdm

from mla_compile.mla_ops.hf_cache import MLACache, cache_kwargs, output_cache


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="local checkpoint directory (default: built-in)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=16, help="random prompt tokens (no --prompt)")
    p.add_argument("--prompt", default=None, help="prompt text (needs the checkpoint's tokenizer)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--backend", default="mla", choices=["mla", "mla_eager"],
                   help="mla: rewrite + Inductor; mla_eager: rewrite only")  # fmt: skip
    return p.parse_args()


def built_in_model(dtype: torch.dtype) -> torch.nn.Module:
    """DeepSeek-V3's layout (q_lora, MLA with L=128, R=32, P=64, V=64, MoE) at a small width."""
    config = transformers.DeepseekV3Config(
        vocab_size=4096, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, n_routed_experts=16,
        n_group=4, topk_group=2, num_experts_per_tok=4, first_k_dense_replace=1,
        kv_lora_rank=128, q_lora_rank=192, qk_nope_head_dim=64, qk_rope_head_dim=32,
        v_head_dim=64, max_position_embeddings=4096,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.DeepseekV3ForCausalLM._from_config(
        config, dtype=dtype, experts_implementation="batched_mm"
    )


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
    """A progress bar over the generated tokens (a stopping criterion that never stops)."""

    def __init__(self, total: int, label: str) -> None:
        self.bar = tqdm(total=total, desc=label, unit="tok", leave=False)

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        self.bar.update(1)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def generate(model, batch: dict, args, cache, label: str) -> tuple[torch.Tensor, float, object]:
    """Greedy generation of exactly ``max_new_tokens``; returns tokens, seconds, the cache."""
    progress = Progress(args.max_new_tokens, label)
    if args.device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(
        **batch, max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens,
        do_sample=False, return_dict_in_generate=True,
        stopping_criteria=transformers.StoppingCriteriaList([progress]),
        pad_token_id=model.generation_config.pad_token_id or 0,
        **cache_kwargs(model, cache),  # `cache=` from transformers 5.24, `past_key_values=` before
    )  # fmt: skip
    if args.device == "cuda":
        torch.cuda.synchronize()
    progress.bar.close()
    return out.sequences, time.perf_counter() - start, output_cache(out)


def cache_bytes_per_token(cache, tokens_per_sequence: int, batch: int) -> float:
    """Bytes the cache's tensors hold per cached token (all layers)."""
    if isinstance(cache, MLACache):
        return float(cache.bytes_per_token())
    total = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    return total / (tokens_per_sequence * batch)


def main() -> None:
    args = parse_args()
    dtype = getattr(torch, args.dtype)
    tokenizer = None
    if args.model is None:
        model = built_in_model(dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    model = model.to(args.device).eval()
    batch = prompts(args, model, tokenizer)  # input_ids [B, S], attention_mask [B, S]
    prompt_len = batch["input_ids"].shape[1]
    cached = prompt_len + args.max_new_tokens - 1  # the last token is never fed back

    # 1. the model as it is, with its default cache (a first run warms it up)
    generate(model, batch, args, None, "warm-up")
    want, took, default_cache = generate(model, batch, args, None, "original")
    original_rate = args.batch_size * args.max_new_tokens / took

    # 2. one line: compile with the MLA rewrite; and the latent cache
    model.forward = torch.compile(model.forward, backend=args.backend)

    def latent_cache() -> MLACache:
        return MLACache(model.config, max_length=prompt_len + args.max_new_tokens,
                        page_size=args.page_size, static=True)  # fmt: skip

    generate(model, batch, args, latent_cache(), "compiling")  # the first call compiles
    got, took, cache = generate(model, batch, args, latent_cache(), 'backend="mla"')
    rate = args.batch_size * args.max_new_tokens / took

    same = (got == want).float().mean().item()
    print(f"model: {args.model or 'built-in DeepSeek-V3-shaped, random weights'}, "
          f"{args.device}, {args.dtype}, batch {args.batch_size}, prompt {prompt_len}")  # fmt: skip
    for name, tokens in (("original", want), ('backend="mla"', got)):
        new = tokens[0, prompt_len:].tolist()
        text = tokenizer.decode(new) if tokenizer is not None else new[:16]
        print(f"{name:>14}: {text}{' ...' if tokenizer is None and len(new) > 16 else ''}")
    verdict = "identical" if same == 1.0 else f"{100 * same:.1f} % of tokens equal"
    print(f"outputs: {verdict}")
    default_bytes = cache_bytes_per_token(default_cache, cached, args.batch_size)
    print(f"{'':>14}  {'tokens/s':>9}  {'cache bytes/token':>18}")
    print(f"{'original':>14}  {original_rate:9.1f}  {default_bytes:18.0f}")
    print(f"{'backend=mla':>14}  {rate:9.1f}  {cache.bytes_per_token():18.0f}")


if __name__ == "__main__":
    main()
