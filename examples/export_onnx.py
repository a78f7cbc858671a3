"""Export a DeepSeek-V3-shaped model's decode step to ONNX and run it in onnxruntime.

The model is small and random (no download). The decode step is exported with a dynamic batch and
cache length, its MLA attention rewritten to ``mla.attention`` (decode + combine) and translated to
standard ONNX operators; one ONNX file then runs at several batch sizes and cache lengths and is
compared with the eager PyTorch model.

    python examples/export_onnx.py                     # writes decode_step.onnx here
    python examples/export_onnx.py --out /tmp/step.onnx --layers 4
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime
import torch
import transformers
from torch.utils import _pytree as pytree

from mla_compile import export


def tiny_deepseek_v3(layers: int) -> torch.nn.Module:
    """DeepSeek-V3's MLA layout at a small width: L=64, R=16, P=32, V=32, 8 heads."""
    config = transformers.DeepseekV3Config(
        vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8,
        n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2,
        first_k_dense_replace=1, kv_lora_rank=64, q_lora_rank=96, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, max_position_embeddings=2048,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM._from_config(
        config, dtype=torch.float32, experts_implementation="batched_mm"
    )
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="decode_step.onnx", help="ONNX file to write")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--translation", default="standard", choices=export.onnx.TRANSLATIONS)
    args = parser.parse_args()

    model = tiny_deepseek_v3(args.layers)
    start = time.perf_counter()
    program = export.export_decode_step(model)  # rewritten: mla.attention per layer
    took = time.perf_counter() - start
    print(f"torch.export + rewrite: {took:.1f} s, {export.mla_op_counts(program)}")
    start = time.perf_counter()
    export.onnx.export_onnx(program, args.out, translation=args.translation)
    print(f"ONNX ({args.translation}): {args.out}, {time.perf_counter() - start:.1f} s")
    if args.translation == "custom":
        print("com.mla nodes need a runtime with its own MLA kernel; not run here")
        return

    session = onnxruntime.InferenceSession(args.out, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    print(f"inputs: {names[:4]} ... ({len(names)})")
    for batch, cache_len in [(1, 10), (4, 100), (2, 700)]:
        inputs = export.decode_inputs(model, batch, cache_len, seed=cache_len)
        # input_ids [B, 1], attention_mask [B, T+1], position_ids [B, 1], past: per layer
        # (latent [B, 1, T, L], k_pe [B, 1, T, R])
        with torch.no_grad():
            want = export.DecodeStep(model)(*inputs)[0]  # logits [B, 1, vocab]
        feeds = {n: t.numpy() for n, t in zip(names, pytree.tree_leaves(inputs))}
        start = time.perf_counter()
        got = session.run(None, feeds)[0]
        took = time.perf_counter() - start
        error = float(np.abs(got - want.numpy()).max() / np.abs(want.numpy()).max())
        print(
            f"B={batch} T={cache_len}: onnxruntime {took * 1e3:.1f} ms, relative error {error:.1e}"
        )


if __name__ == "__main__":
    main()
