"""mla_combine: merging attention states by LSE, against a float64 reference."""

from __future__ import annotations

import pytest
import torch

from mla_compile import mla_ops
from mla_compile.mla_ops import device as device_facts
from mla_compile.mla_ops import planner, reference, runtime, splits, tiling, triton_kernels  # noqa: F401
from tests.conftest import HAS_CUDA
from tests.mla_ops.cases import make_case

DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])


def merge64(out_p: torch.Tensor, lse_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: softmax-weighted sum, one row at a time, in float64."""
    out_p, lse_p = out_p.double().cpu(), lse_p.double().cpu()
    out = torch.zeros(out_p.shape[:-2] + out_p.shape[-1:], dtype=torch.float64)
    lse = torch.full(lse_p.shape[:-1], float("-inf"), dtype=torch.float64)
    for idx in torch.cartesian_prod(*[torch.arange(n) for n in lse_p.shape[:-1]]).reshape(
        -1, lse_p.dim() - 1
    ):
        i = tuple(idx.tolist())
        alive = torch.isfinite(lse_p[i])
        if not alive.any():
            continue
        lse[i] = torch.logsumexp(lse_p[i][alive], 0)
        w = torch.exp(lse_p[i][alive] - lse[i])
        out[i] = (w[:, None] * out_p[i][alive]).sum(0)
    return out, lse


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits", [1, 2, 7, 65, 128])  # 128: a single sequence's plan
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_matches_reference(device: str, num_splits: int, dtype: torch.dtype) -> None:
    out_p = torch.randn(2, 3, 5, num_splits, 24, dtype=dtype, device=device)
    lse_p = (torch.randn(2, 3, 5, num_splits, device=device) * 4).to(dtype)
    lse_p[0, 1, 2] = float("-inf")
    if num_splits > 1:
        lse_p[1, 0, :, 1] = float("-inf")
    out, lse = mla_ops.mla_combine(out_p, lse_p)
    ref, ref_lse = merge64(out_p, lse_p)
    assert out.dtype == dtype and out.shape == (2, 3, 5, 24)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out.cpu().double(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.cpu().double(), ref_lse, atol=tol, rtol=tol)
    assert (out[0, 1, 2] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_out_dtype(device: str) -> None:
    out, lse = mla_ops.mla_combine(
        torch.randn(4, 2, 8, device=device), torch.randn(4, 2, device=device), torch.bfloat16
    )
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32


@pytest.mark.parametrize("device", DEVICES)
def test_prefix_and_suffix_states_merge_into_full_attention(device: str) -> None:
    """Combine is not only for splits: attention over a prefix and a suffix computed apart."""
    case = make_case(11, device=device, lengths=[90, 130], s_q=1, causal=False, page_size=None)
    split_at = torch.tensor([40, 77])
    seq = case.cache_seqlens.cpu()
    prefix = case.reference(token_range=(torch.zeros(2, dtype=torch.long), split_at))
    suffix = case.reference(token_range=(split_at, seq.long()))
    out_p = torch.stack([prefix[0], suffix[0]], dim=-2).float().to(device)
    lse_p = torch.stack([prefix[1], suffix[1]], dim=-1).float().to(device)
    out, lse = mla_ops.mla_combine(out_p, lse_p)
    full_out, full_lse = case.reference()
    torch.testing.assert_close(out.cpu().double(), full_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.cpu().double(), full_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_nan_state_propagates(device: str) -> None:
    lse_p = torch.zeros(3, 2, device=device)
    lse_p[1, 0] = float("nan")
    out, lse = mla_ops.mla_combine(torch.ones(3, 2, 4, device=device), lse_p)
    assert torch.isnan(out[1]).all() and torch.isnan(lse[1])
    assert not torch.isnan(out[[0, 2]]).any()


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("page_size", [64, 1])
def test_decode_then_combine_in_a_cuda_graph_matches_eager(page_size: int) -> None:
    """On sm_90+ the combine is launched early (programmatic dependent launch, ``has_pdl``) and
    waits on the device for the decode's partials: captured in a CUDA graph, replays of
    ``mla_decode`` on new inputs equal eager calls bit for bit, and so does a combine whose
    partials a plain PyTorch kernel wrote just before it."""

    case = make_case(
        90 + page_size, dtype=torch.bfloat16, device="cuda", page_size=page_size, dims=(512, 64),
        heads=16, s_q=1, lengths=[3000, 1, 700, 0],
    )  # fmt: skip
    q, kv_c, k_pe, seqlens, table = (
        case.q.clone(), case.kv_c.clone(), case.k_pe.clone(), case.cache_seqlens, case.block_table
    )  # fmt: skip

    def call() -> torch.Tensor:  # the planner's splits: several per sequence here
        return mla_ops.mla_decode(
            q, (kv_c, k_pe), seqlens, block_table=table, head_dim_v=512, softmax_scale=0.1
        )[0]

    call()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_graph = call()
    for seed in range(3):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        q.copy_(torch.randn(q.shape, generator=gen, device="cuda"))
        kv_c.copy_(torch.randn(kv_c.shape, generator=gen, device="cuda"))
        graph.replay()
        assert torch.equal(out_graph, call()), seed
    # Partials written by an ordinary kernel right before the combine (the stream's previous
    # kernel is then no decode kernel and triggers nothing early).
    out_p = torch.empty(64, 6, 512, device="cuda")
    lse_p = torch.empty(64, 6, device="cuda")
    for _ in range(3):
        torch.randn(out_p.shape, out=out_p, device="cuda")
        torch.randn(lse_p.shape, out=lse_p, device="cuda")
        out, lse = mla_ops.mla_combine(out_p, lse_p)
        ref, ref_lse = merge64(out_p, lse_p)
        torch.testing.assert_close(out.cpu().double(), ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse.cpu().double(), ref_lse, atol=1e-5, rtol=1e-5)
    assert device_facts.has_pdl(q.device) == (torch.cuda.get_device_capability()[0] >= 9)
