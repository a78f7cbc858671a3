"""``export.decompositions``: the ``mla`` ops decomposed into ATen ops give the ops' own results,
and leave no call into Python in the program."""

from __future__ import annotations

import pytest
import torch

from mla_compile import mla_ops  # noqa: F401  (registers torch.ops.mla.*)
from mla_compile.export import decompositions

pytestmark = pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)`:FutureWarning")


class SplitsThenMerge(torch.nn.Module):
    """``mla::decode`` over a paged cache, then ``mla::combine``, then ``mla::attention``."""

    def forward(self, q, pool, block_table, cache_seqlens, mask):
        kv_c, k_pe = pool[..., :32], pool[..., 32:]
        parts = torch.ops.mla.decode(q, kv_c, k_pe, cache_seqlens, block_table, 0.2, True, 3)
        merged, lse = torch.ops.mla.combine(*parts, torch.float32)
        out, _ = torch.ops.mla.attention(
            q, kv_c, k_pe, cache_seqlens, block_table, 0.2, False, 2, attn_mask=mask
        )
        return merged, lse, out


def test_decomposed_ops_match_the_ops() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 2, 5, 40, generator=gen)  # odd heads, S_q = 2
    pool = torch.randn(10, 4, 40, generator=gen)  # page size 4
    block_table = torch.randperm(10, generator=gen)[:9].view(3, 3).int()
    cache_seqlens = torch.tensor([11, 0, 6], dtype=torch.int32)  # an empty sequence
    mask = torch.rand(3, 2, 12, generator=gen) > 0.3
    args = (q, pool, block_table, cache_seqlens, mask)
    program = torch.export.export(SplitsThenMerge(), args)
    free = decompositions.python_free(program)
    targets = {str(n.target) for n in free.graph.nodes if n.op == "call_function"}
    assert not any(t.startswith("mla.") for t in targets), targets
    for got, want in zip(free.module()(*args), SplitsThenMerge()(*args), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, equal_nan=True)
