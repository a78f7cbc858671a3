"""What torch's dispatch of a custom op with ``mla::attention``'s schema costs on the host, by the
way the op is registered.

    python benchmarks/experiments/op_dispatch.py [--calls 2000] [--out DIR]

Three ops of the same schema (11 arguments) whose CUDA kernel only allocates its two outputs:
``torch.library.custom_op`` (how ``mla_ops`` registers its ops: a Python autograd layer that
redispatches, then a Python backend layer under dynamo's disable wrapper), the same op called
through its ``.default`` overload, and an op defined with ``torch.library.Library`` and a CUDA
kernel registered with ``Library.impl`` (no autograd kernel: torch's C++ fallback), each against
the kernel function called directly. Host microseconds per call (median of 5 rounds).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_overhead import host_us

SCHEMA = (
    "(Tensor q, Tensor kv_c, Tensor k_pe, Tensor cache_seqlens, Tensor? block_table, "
    "float softmax_scale, bool causal, int num_splits, float? kv_scale=None, "
    "Tensor? attn_mask=None, int? total_splits=None) -> (Tensor, Tensor)"
)


def kernel(q, kv_c, k_pe, cache_seqlens, block_table, softmax_scale, causal, num_splits,
           kv_scale=None, attn_mask=None, total_splits=None):  # fmt: skip
    return q.new_empty((*q.shape[:3], kv_c.shape[-1])), q.new_empty(q.shape[:3])


@torch.library.custom_op("op_dispatch::custom", mutates_args=())
def custom(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    softmax_scale: float,
    causal: bool,
    num_splits: int,
    kv_scale: float | None = None,
    attn_mask: torch.Tensor | None = None,
    total_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The op of ``custom_op``'s registration; its CUDA kernel is ``kernel``."""
    raise NotImplementedError


custom.register_kernel("cuda")(kernel)
custom.register_fake(kernel)

LIB = torch.library.Library("op_dispatch", "FRAGMENT")
LIB.define("library" + SCHEMA)
LIB.impl("library", kernel, "CUDA")
torch.library.register_fake("op_dispatch::library", kernel, lib=LIB)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    q = torch.randn(1, 1, 16, 576, device="cuda", dtype=torch.bfloat16)
    cache = torch.randn(4, 64, 576, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((1,), 100, dtype=torch.int32, device="cuda")
    table = torch.arange(4, dtype=torch.int32, device="cuda")[None]
    call = (q, cache[..., :512], cache[..., 512:], lens, table, 0.1, True, 1, None, None, None)
    fns = {
        "kernel called directly": lambda: kernel(*call),
        "custom_op: torch.ops.op_dispatch.custom": lambda: torch.ops.op_dispatch.custom(*call),
        "custom_op: .default": lambda: torch.ops.op_dispatch.custom.default(*call),
        "Library.impl: torch.ops.op_dispatch.library": lambda: torch.ops.op_dispatch.library(*call),
        "Library.impl: .default": lambda: torch.ops.op_dispatch.library.default(*call),
    }

    def under(mode):
        def fn():
            with mode():
                return torch.ops.op_dispatch.custom(*call)

        return fn

    fns["custom_op under torch.no_grad()"] = under(torch.no_grad)
    fns["custom_op under torch.inference_mode()"] = under(torch.inference_mode)
    rows = {}
    for _ in range(2):  # the first round of a run can read high
        for name, fn in fns.items():
            fn()
            rows[name] = host_us(fn, args.calls)
    for name, us in rows.items():
        print(f"{name:48s} {us:7.1f} us")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "op_dispatch.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
