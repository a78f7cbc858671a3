"""torch.compile(fullgraph=True) and torch.export see one mla.attention node (mla.decode and
mla.combine as one op), with symbolic batch and cache length (no recompile when the cache grows)."""

from __future__ import annotations

import pytest
import torch

from mla_compile import mla_ops
from tests.conftest import HAS_CUDA
from tests.mla_ops.cases import make_case

DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
L, R, H = 32, 16, 4


def decode_step(q, kv_cache, cache_seqlens):
    return mla_ops.mla_decode(q, kv_cache, cache_seqlens, head_dim_v=L, softmax_scale=0.125)


class DecodeStep(torch.nn.Module):
    def forward(self, q, kv_cache, cache_seqlens):
        return decode_step(q, kv_cache, cache_seqlens)


def inputs(batch: int, length: int, device: str):
    case = make_case(
        batch * 1000 + length,
        device=device,
        batch=batch,
        s_q=1,
        heads=H,
        dims=(L, R),
        page_size=None,
        lengths=[length] * batch,
        pair=False,
    )
    return case.q, case.kv_cache, case.cache_seqlens


def assert_matches_eager(fn, batch: int, length: int, device: str) -> None:
    args = inputs(batch, length, device)
    out, lse = fn(*args)
    ref_out, ref_lse = decode_step(*args)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)


def mla_nodes(graph: torch.fx.Graph) -> list[str]:
    """Names of the mla op calls in ``graph`` (overload packet or ``.default`` alike)."""
    return [
        str(n.target).removesuffix(".default")
        for n in graph.nodes
        if n.op == "call_function" and str(n.target).startswith("mla.")
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_dynamic_one_node_each_no_recompile(device: str) -> None:
    graphs: list[torch.fx.GraphModule] = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(decode_step, backend=recording_backend, fullgraph=True, dynamic=True)
    # Sizes 0 and 1 are specialised by dynamo itself (its 0/1 rule), so the sweep starts at 2.
    for batch, length in [(2, 50), (3, 80), (5, 200), (4, 17)]:
        assert_matches_eager(compiled, batch, length, device)
    assert len(graphs) == 1, f"recompiled: {len(graphs)} graphs"
    nodes = mla_nodes(graphs[0].graph)
    assert nodes == ["mla.attention"], nodes


@pytest.mark.parametrize("device", DEVICES)
def test_compile_inductor(device: str) -> None:
    torch._dynamo.reset()
    compiled = torch.compile(decode_step, fullgraph=True, dynamic=True)
    for batch, length in [(2, 50), (3, 90)]:
        assert_matches_eager(compiled, batch, length, device)


@pytest.mark.parametrize("device", DEVICES)
def test_export_dynamic_batch_and_length(device: str) -> None:
    batch, length = torch.export.Dim("batch", min=1, max=1024), torch.export.Dim("T", min=2)
    ep = torch.export.export(
        DecodeStep(),
        inputs(2, 50, device),
        dynamic_shapes={
            "q": {0: batch},
            "kv_cache": {0: batch, 1: length},
            "cache_seqlens": {0: batch},
        },
    )
    assert mla_nodes(ep.graph) == ["mla.attention"]
    module = ep.module()
    for batch, length in [(3, 70), (1, 300)]:
        assert_matches_eager(module, batch, length, device)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fp8_cache(device: str) -> None:
    case = make_case(
        31,
        device=device,
        s_q=1,
        heads=H,
        dims=(L, R),
        page_size=16,
        lengths=[40, 17],
        cache_dtype=torch.float8_e4m3fn,
        pair=False,
    )

    def step(q, kv_cache, cache_seqlens, block_table):
        return mla_ops.mla_decode(
            q,
            kv_cache,
            cache_seqlens,
            block_table=block_table,
            head_dim_v=L,
            softmax_scale=0.125,
            kv_scale=case.kv_scale,
        )

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    args = (case.q, case.kv_cache, case.cache_seqlens, case.block_table)
    out, lse = compiled(*args)
    ref_out, ref_lse = step(*args)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
