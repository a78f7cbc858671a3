"""ATen decompositions of the ops an exported MLA program calls back into Python for, so that
what runs it needs no Python: the ``mla`` ops (their PyTorch implementation,
``mla_ops.reference``) and transformers' grouped experts product. Used by
``export.aoti.compile_package(..., python_free=True)`` and by the ONNX export, whose exporter
translates none of these ops itself.
"""

from __future__ import annotations

import torch

from mla_compile.mla_ops import reference


def mla_attention(
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
    """``mla::attention`` in ATen ops: the split-KV partials, then their LSE merge into q's
    dtype (``mla_ops.reference``, the ops' CPU implementation, functional)."""
    partials = reference.decode(
        q, kv_c, k_pe, cache_seqlens, block_table, softmax_scale, causal, num_splits, kv_scale,
        attn_mask, total_splits,
    )  # fmt: skip
    return reference.combine(*partials, q.dtype)


def mla_decode(*args, fill_empty: bool = True, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """``mla::decode`` in ATen ops (an empty split's output is zeros, whatever ``fill_empty``)."""
    del fill_empty
    return reference.decode(*args, **kwargs)


def mla_decompositions() -> dict:
    """``mla::attention``, ``mla::decode`` and ``mla::combine`` to their ATen forms."""
    import mla_compile.mla_ops  # noqa: F401  (defines torch.ops.mla.*)

    return {
        torch.ops.mla.attention.default: mla_attention,
        torch.ops.mla.decode.default: mla_decode,
        torch.ops.mla.combine.default: reference.combine,
    }


def grouped_rows_mm(
    input: torch.Tensor,
    weight: torch.Tensor,
    offs: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """A grouped product as one batched product: row ``s`` of ``input [S, K]`` times
    ``weight[e] [K, N]``, ``e`` the group whose range ``[offs[e - 1], offs[e])`` holds ``s``;
    rows past ``offs[-1]`` give zeros. Returns ``[S, N]``.

    What transformers' experts (``experts_implementation="grouped_mm"``, its default) emit:
    ``aten._grouped_mm`` for bfloat16 and ``transformers::grouped_mm_fallback`` otherwise, neither
    of which the ONNX exporter translates (and the second a Python op). This form uses only
    comparisons, a gather and a batched matmul; it holds one ``[K, N]`` weight per row
    (``S * K * N`` elements), which is what a decode step (``S`` = batch x experts per token) can
    afford.
    """
    if input.dim() != 2 or weight.dim() != 3 or offs is None:
        raise NotImplementedError(
            "grouped_rows_mm translates the experts' form only: input [S, K], weight [E, K, N] "
            f"and offs [E]; got input {tuple(input.shape)}, weight {tuple(weight.shape)}, "
            f"offs {None if offs is None else tuple(offs.shape)}"
        )
    rows = torch.arange(input.shape[0], device=input.device, dtype=offs.dtype)
    group = (offs.unsqueeze(0) <= rows.unsqueeze(1)).sum(dim=1)  # [S]: E past offs[-1]
    inside = group < weight.shape[0]
    group = group.clamp(max=weight.shape[0] - 1)
    out = torch.matmul(input.to(weight.dtype).unsqueeze(1), weight[group]).squeeze(1)  # [S, N]
    if bias is not None:
        out = out + bias[group]
    out = torch.where(inside.unsqueeze(1), out, torch.zeros((), dtype=out.dtype))
    return out if out_dtype is None else out.to(out_dtype)


def experts_decompositions(aten_grouped_mm: bool) -> dict:
    """transformers' Python grouped product (``transformers::grouped_mm_fallback``, where
    transformers registered it) to ``grouped_rows_mm``; ``aten_grouped_mm``: ``aten._grouped_mm``
    too (an ATen op AOTInductor compiles, but the ONNX exporter does not translate)."""
    table = {}
    if aten_grouped_mm:
        table[torch.ops.aten._grouped_mm.default] = grouped_rows_mm
    fallback = getattr(torch.ops.transformers, "grouped_mm_fallback", None)
    if fallback is not None:
        table[fallback.default] = grouped_rows_mm
    return table


def python_free(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """A copy of ``program`` (weights shared) in which no op calls back into Python: the
    ``mla`` ops and transformers' experts product decomposed into ATen ops."""
    return program.run_decompositions(
        {**mla_decompositions(), **experts_decompositions(aten_grouped_mm=False)}
    )
