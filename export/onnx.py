"""ONNX export of programs that call the ``mla`` ops (``torch.onnx.export(..., dynamo=True)``).

Two translations of ``mla::decode`` and ``mla::combine`` (``mla::attention``, the one op the
rewrite emits, is translated as those two in sequence; ``_with_attention``):

* ``"standard"`` (default): standard ONNX operators (opset 18) that compute exactly what the
  PyTorch implementation (``mla_ops/reference.py``) computes: the same split boundaries, the same
  empty-split and hidden-key conventions. The model runs in any ONNX runtime, e.g. onnxruntime's
  CPU provider, with dynamic batch and cache length.
* ``"custom"``: one node per op in the ``com.mla`` domain (``com.mla::Decode``,
  ``com.mla::Combine``, version 1), for runtimes that bring their own MLA kernel. Their schemas
  are registered with ``onnx.defs`` by ``register_custom_schemas()`` so ``onnx.checker`` and shape
  inference accept them; onnxruntime has no kernel for them.

Why a faithful translation (splits included) rather than one attention: ``mla::decode``'s outputs
are the split partials, and a graph that consumes them (``mla::combine`` or the user's own merge)
must see the same values as in PyTorch.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch

from mla_compile.mla_ops.planner import MIN_CHUNK, SPLIT_GRANULE
from mla_compile.mla_ops.reference import MASK_HIDDEN, mask_hidden_threshold

from .decompositions import experts_decompositions

CUSTOM_DOMAIN = "com.mla"
CUSTOM_DOMAIN_VERSION = 1
OPSET = 18
TRANSLATIONS = ("standard", "custom")


def _require_onnxscript() -> None:
    try:
        import onnxscript  # noqa: F401
    except ImportError as error:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "ONNX export needs onnx, onnxscript and onnxruntime: pip install 'mla-compile[onnx]'"
        ) from error


def _onnx_dtype(dtype: Any) -> int:
    """ONNX TensorProto data type of a torch dtype (the exporter passes dtypes as torch dtypes
    or as ONNX enum ints)."""
    from onnx import TensorProto

    if isinstance(dtype, int):
        return dtype
    table = {
        torch.float32: TensorProto.FLOAT,
        torch.float64: TensorProto.DOUBLE,
        torch.float16: TensorProto.FLOAT16,
        torch.bfloat16: TensorProto.BFLOAT16,
    }
    if dtype not in table:
        raise TypeError(f"mla ONNX export: unsupported dtype {dtype}")
    return table[dtype]


# --- standard ONNX translation -----------------------------------------------------------------


def _standard_table() -> dict[Callable, Callable]:
    from onnxscript import opset18 as op

    def const_i64(values: list[int]):
        return op.Constant(value_ints=values)

    def scalar_like(value: float, like):
        # A float64 constant cast to like's dtype: value_float would round the softmax scale
        # to float32, which a float64 graph would notice (1e-7 relative).
        import numpy as np
        import onnx_ir

        return op.CastLike(op.Constant(value=onnx_ir.tensor(np.array(value, np.float64))), like)

    def acc_type(x) -> int:
        from onnx import TensorProto

        return TensorProto.DOUBLE if x.dtype == _dtype_of("DOUBLE") else TensorProto.FLOAT

    def decode(
        q,
        kv_c,
        k_pe,
        cache_seqlens,
        block_table=None,
        softmax_scale: float = 1.0,
        causal: bool = False,
        num_splits: int = 1,
        kv_scale: float | None = None,
        attn_mask=None,
        total_splits: int | None = None,
        fill_empty: bool = True,
    ):
        # fill_empty=False lets an empty split's out be anything: the zeros below are one such.
        del fill_empty
        acc = acc_type(q)
        zero_i = const_i64([0])
        one_i = const_i64([1])

        def rows_of(part):
            if part.dtype == _dtype_of("FLOAT8E4M3FN"):
                raise ValueError(
                    "mla ONNX export: a float8_e4m3fn latent cache is not supported by the "
                    "standard translation (opset 18 has no float8); use translation='custom'"
                )
            return op.Cast(part, to=acc)

        rows = op.Concat(rows_of(kv_c), rows_of(k_pe), axis=-1)  # [N, P, D] or [B, T, D]
        seqlen = op.Cast(cache_seqlens, to=_int64())  # [B]
        if block_table is not None:
            # Pages past a sequence's last one are never read: clamp them, as the reference does.
            num_pages = op.Shape(rows, start=0, end=1)
            page_size = op.Shape(rows, start=1, end=2)
            dim = op.Shape(rows, start=2, end=3)
            pages_used = op.Div(op.Sub(op.Add(seqlen, page_size), one_i), page_size)  # [B]
            page_pos = op.Range(
                op.Constant(value_int=0), op.Squeeze(op.Shape(block_table, start=1, end=2)), 1
            )
            in_use = op.Less(op.Unsqueeze(page_pos, zero_i), op.Unsqueeze(pages_used, one_i))
            pages = op.Where(in_use, op.Cast(block_table, to=_int64()), zero_i)
            pages = op.Clip(pages, op.Squeeze(zero_i), op.Squeeze(op.Sub(num_pages, one_i)))
            rows = op.Gather(rows, pages, axis=0)  # [B, max_pages, P, D]
            rows = op.Reshape(rows, op.Concat(const_i64([0, -1]), dim, axis=0))  # [B, T, D]
        capacity = op.Shape(rows, start=1, end=2)  # [1]
        token = op.Range(
            op.Constant(value_int=0), op.Squeeze(capacity), op.Constant(value_int=1)
        )  # [T]
        seq_col = op.Unsqueeze(seqlen, one_i)  # [B, 1]
        in_seq = op.Less(op.Unsqueeze(token, zero_i), seq_col)  # [B, T]
        zero = scalar_like(0.0, rows)
        neg_inf = scalar_like(-math.inf, rows)
        # Rows past a sequence's end are stale memory (maybe NaN): 0 * NaN would leak into P @ V.
        rows = op.Where(op.Unsqueeze(in_seq, const_i64([2])), rows, zero)
        q_acc = op.Cast(q, to=acc)
        scale = scalar_like(softmax_scale, rows)
        scores = op.Mul(op.Einsum(q_acc, rows, equation="bshd,btd->bsht"), scale)  # [B,S,H,T]

        visible = op.Unsqueeze(in_seq, one_i)  # [B, 1, T]
        s_q = op.Shape(q, start=1, end=2)  # [1]
        if causal:
            query_pos = op.Range(
                op.Constant(value_int=0), op.Squeeze(s_q), op.Constant(value_int=1)
            )  # [S]
            last_key = op.Add(op.Sub(seq_col, s_q), op.Unsqueeze(query_pos, zero_i))  # [B, S]
            causal_ok = op.LessOrEqual(
                op.Unsqueeze(op.Unsqueeze(token, zero_i), zero_i),
                op.Unsqueeze(last_key, const_i64([2])),
            )  # [B, S, T]
            visible = op.And(visible, causal_ok)
        if attn_mask is not None:
            # Mask positions T_m and past are hidden: read the mask at min(token, T_m - 1) and
            # hide what lies past its end, so any T_m (shorter or longer) lines up with T.
            mask_len = op.Shape(attn_mask, start=2, end=3)
            inside = op.Less(token, mask_len)  # [T]
            index = op.Min(token, op.Sub(mask_len, one_i))
            values = op.Gather(attn_mask, index, axis=2)  # [B, S, T]
            if attn_mask.dtype == _dtype_of("BOOL"):
                mask_visible = values
                bias = None
            else:
                values = op.Cast(values, to=acc)
                hidden_at = MASK_HIDDEN
                if attn_mask.dtype == _dtype_of("FLOAT16"):
                    hidden_at = mask_hidden_threshold(torch.float16)
                mask_visible = op.Greater(values, scalar_like(hidden_at, values))
                bias = op.Where(op.And(mask_visible, inside), values, zero)
            visible = op.And(visible, op.And(mask_visible, inside))
            if bias is not None:
                scores = op.Add(scores, op.Unsqueeze(bias, const_i64([2])))
        # Keys no query sees (left padding) may hold NaN: keep them out of P @ V.
        seen = op.ReduceMax(op.Cast(visible, to=acc), one_i, keepdims=0)  # [B, T]
        kv_len = op.Shape(kv_c, start=2, end=3)
        values_rows = op.Slice(rows, zero_i, kv_len, const_i64([2]))  # [B, T, L]
        values_rows = op.Where(
            op.Unsqueeze(op.Greater(seen, zero), const_i64([2])), values_rows, zero
        )

        # split_bounds (mla_ops/planner.py): chunk = max(round_up(ceil(len / n), GRANULE), MIN),
        # and with total_splits at least round_up(ceil(sum(len) / total_splits), GRANULE).
        granule = const_i64([SPLIT_GRANULE])

        def ceil_to_granule(tokens, parts: int):
            per_part = op.Div(op.Add(tokens, const_i64([parts - 1])), const_i64([parts]))
            return op.Mul(
                op.Div(op.Add(per_part, const_i64([SPLIT_GRANULE - 1])), granule), granule
            )

        per_split = ceil_to_granule(seqlen, num_splits)  # [B]
        if total_splits is not None:
            total = op.ReduceSum(seqlen, zero_i, keepdims=1)  # [1]
            per_split = op.Max(per_split, ceil_to_granule(total, total_splits))
        chunk = op.Max(per_split, const_i64([MIN_CHUNK]))  # [B]
        outs, lses = [], []
        for split in range(num_splits):
            start = op.Mul(chunk, const_i64([split]))
            end = op.Min(op.Add(start, chunk), seqlen)
            token_row = op.Unsqueeze(token, zero_i)  # [1, T]
            in_split = op.And(
                op.GreaterOrEqual(token_row, op.Unsqueeze(start, one_i)),
                op.Less(token_row, op.Unsqueeze(end, one_i)),
            )  # [B, T]
            mask = op.Unsqueeze(op.And(visible, op.Unsqueeze(in_split, one_i)), const_i64([2]))
            masked = op.Where(mask, scores, neg_inf)  # [B, S, H, T]
            row_max = op.ReduceMax(masked, const_i64([3]), keepdims=1)
            shift = op.Where(op.IsInf(row_max, detect_positive=0), zero, row_max)
            probs = op.Exp(op.Sub(masked, shift))
            total = op.ReduceSum(probs, const_i64([3]), keepdims=1)  # [B, S, H, 1]
            one = scalar_like(1.0, total)
            probs = op.Div(probs, op.Where(op.Equal(total, zero), one, total))
            out = op.Einsum(probs, values_rows, equation="bsht,btl->bshl")  # [B, S, H, L]
            lse = op.Add(row_max, op.Log(total))  # [B, S, H, 1]
            outs.append(op.Unsqueeze(out, const_i64([3])))
            lses.append(lse)
        out_partial = outs[0] if num_splits == 1 else op.Concat(*outs, axis=3)
        lse_partial = lses[0] if num_splits == 1 else op.Concat(*lses, axis=3)
        return out_partial, lse_partial

    def combine(out_partial, lse_partial, out_dtype=None):
        acc = acc_type(out_partial)
        minus_one = const_i64([-1])
        lse_partial = op.Cast(lse_partial, to=acc)
        out_partial = op.Cast(out_partial, to=acc)
        zero = scalar_like(0.0, lse_partial)
        one = scalar_like(1.0, lse_partial)
        lse_max = op.ReduceMax(lse_partial, minus_one, keepdims=1)
        # All splits empty: shift by 0 so the weights are exactly 0 and the output is 0, not NaN.
        shift = op.Where(op.IsInf(lse_max, detect_positive=0), zero, lse_max)
        weight = op.Exp(op.Sub(lse_partial, shift))  # [..., S]
        total = op.ReduceSum(weight, minus_one, keepdims=0)
        lse = op.Add(op.Log(total), op.Squeeze(shift, minus_one))
        weight_col = op.Unsqueeze(weight, minus_one)
        parts = op.Where(op.Greater(weight_col, zero), out_partial, zero)
        summed = op.ReduceSum(op.Mul(weight_col, parts), const_i64([-2]), keepdims=0)
        out = op.Div(summed, op.Unsqueeze(op.Where(op.Equal(total, zero), one, total), minus_one))
        # NaN in a partial LSE (the kernels' poison for unreadable locations) must survive.
        poisoned = op.Cast(
            op.ReduceMax(op.Cast(op.IsNaN(lse_partial), to=acc), minus_one, keepdims=0), to=_bool()
        )
        nan = scalar_like(math.nan, out)
        out = op.Where(op.Unsqueeze(poisoned, minus_one), nan, out)
        if out_dtype is not None:
            out = op.Cast(out, to=_onnx_dtype(out_dtype))
        return out, lse

    return _with_attention(decode, combine)


def _with_attention(decode: Callable, combine: Callable) -> dict[Callable, Callable]:
    """A translation table of ``decode``, ``combine`` and ``mla::attention`` = decode (partials)
    then combine into q's dtype, the ops' own definition."""

    def attention(q, *args, **kwargs):
        out_partial, lse_partial = decode(q, *args, **kwargs)
        return combine(out_partial, lse_partial, q.dtype)

    return {
        torch.ops.mla.decode.default: decode,
        torch.ops.mla.combine.default: combine,
        torch.ops.mla.attention.default: attention,
    }


def _dtype_of(name: str):
    import onnx_ir

    return getattr(onnx_ir.DataType, name)


def _dtype_of_enum(value: int):
    import onnx_ir

    return onnx_ir.DataType(value)


def _int64() -> int:
    from onnx import TensorProto

    return TensorProto.INT64


def _bool() -> int:
    from onnx import TensorProto

    return TensorProto.BOOL


# --- custom-domain translation (com.mla) --------------------------------------------------------

_FLOATS = ["tensor(float)", "tensor(double)", "tensor(float16)", "tensor(bfloat16)"]


def _custom_schemas() -> list:
    from onnx.defs import OpSchema

    optional = OpSchema.FormalParameterOption.Optional
    param = OpSchema.FormalParameter
    attr = OpSchema.Attribute
    decode = OpSchema(
        "Decode",
        CUSTOM_DOMAIN,
        CUSTOM_DOMAIN_VERSION,
        doc="mla::decode: split-KV MLA decode partials over a (paged) latent cache "
        "(see mla_ops/ops.py for the contract).",
        inputs=[
            param("q", "T", "[B, S_q, H, L+R] absorbed query"),
            param("kv_c", "TC", "[num_pages, page_size, L] or [B, T, L]"),
            param("k_pe", "TC", "[num_pages, page_size, R] or [B, T, R]"),
            param("cache_seqlens", "tensor(int32)", "[B] valid tokens per sequence"),
            param("block_table", "tensor(int32)", "[B, max_pages]", param_option=optional),
            param("attn_mask", "TM", "[B, S_q, T_m] bool or additive", param_option=optional),
        ],
        outputs=[
            param("out_partial", "TA", "[B, S_q, H, num_splits, L]"),
            param("lse_partial", "TA", "[B, S_q, H, num_splits], natural log"),
        ],
        type_constraints=[
            ("T", _FLOATS, "query dtype"),
            ("TC", [*_FLOATS, "tensor(float8e4m3fn)"], "cache dtype"),
            ("TM", ["tensor(bool)", *_FLOATS], "mask dtype"),
            ("TA", ["tensor(float)", "tensor(double)"], "accumulation dtype"),
        ],
        attributes=[
            attr("softmax_scale", OpSchema.AttrType.FLOAT, "score scale"),
            attr("causal", OpSchema.AttrType.INT, "1: query i sees keys <= len - S_q + i"),
            attr("num_splits", OpSchema.AttrType.INT, "split-KV chunks per sequence"),
            attr(
                "total_splits",
                OpSchema.AttrType.INT,
                "chunks over the batch (one chunk length for all sequences)",
                required=False,
            ),
            attr("kv_scale", OpSchema.AttrType.FLOAT, "float8 dequant scale", required=False),
        ],
    )
    combine = OpSchema(
        "Combine",
        CUSTOM_DOMAIN,
        CUSTOM_DOMAIN_VERSION,
        doc="mla::combine: LSE merge of attention states over dimension -2.",
        inputs=[
            param("out_partial", "TA", "[..., S, L]"),
            param("lse_partial", "TA", "[..., S]"),
        ],
        outputs=[param("out", "T", "[..., L]"), param("lse", "TA", "[...]")],
        type_constraints=[
            ("TA", ["tensor(float)", "tensor(double)"], "accumulation dtype"),
            ("T", _FLOATS, "output dtype"),
        ],
        attributes=[attr("out_dtype", OpSchema.AttrType.INT, "ONNX dtype of out")],
    )
    return [decode, combine]


def register_custom_schemas() -> None:
    """Register the ``com.mla`` op schemas with ``onnx.defs`` (idempotent), so
    ``onnx.checker.check_model`` and shape inference accept ``com.mla`` nodes."""
    from onnx import defs

    for schema in _custom_schemas():
        if not defs.has(schema.name, schema.domain):
            defs.register_schema(schema)


def _custom_table() -> dict[Callable, Callable]:
    from onnxscript.values import Opset

    register_custom_schemas()
    mla = Opset(CUSTOM_DOMAIN, CUSTOM_DOMAIN_VERSION)

    def decode(
        q,
        kv_c,
        k_pe,
        cache_seqlens,
        block_table=None,
        softmax_scale: float = 1.0,
        causal: bool = False,
        num_splits: int = 1,
        kv_scale: float | None = None,
        attn_mask=None,
        total_splits: int | None = None,
        fill_empty: bool = True,
    ):
        # The custom node gives empty splits zeros (its schema's contract), which also satisfies
        # fill_empty=False.
        del fill_empty
        attributes = dict(
            softmax_scale=float(softmax_scale), causal=int(causal), num_splits=int(num_splits)
        )
        if kv_scale is not None:
            attributes["kv_scale"] = float(kv_scale)
        if total_splits is not None:
            attributes["total_splits"] = int(total_splits)
        out, lse = mla.Decode(q, kv_c, k_pe, cache_seqlens, block_table, attn_mask, **attributes)
        acc = _dtype_of("DOUBLE") if q.dtype == _dtype_of("DOUBLE") else _dtype_of("FLOAT")
        out.type = lse.type = _tensor_type(acc)  # a custom node's outputs have no inferred type
        return out, lse

    def combine(out_partial, lse_partial, out_dtype=None):
        dtype = _onnx_dtype(out_dtype) if out_dtype is not None else out_partial.dtype.value
        out, lse = mla.Combine(out_partial, lse_partial, out_dtype=dtype)
        out.type, lse.type = _tensor_type(_dtype_of_enum(dtype)), _tensor_type(out_partial.dtype)
        return out, lse

    return _with_attention(decode, combine)


def step_io_names(
    program: torch.export.ExportedProgram,
) -> tuple[list[str] | None, list[str] | None]:
    """ONNX names for a ``DecodeStep`` / ``PrefillStep`` program: ``input_ids``,
    ``attention_mask``, ``position_ids``, ``past.{layer}.key|value`` in; ``logits``,
    ``present.{layer}.key|value`` out. ``(None, None)`` for any other program."""
    inputs = list(program.graph_signature.user_inputs)
    outputs = list(program.graph_signature.user_outputs)
    head = ["input_ids", "attention_mask", "position_ids"]
    past, present = len(inputs) - 3, len(outputs) - 1
    if inputs[:3] != head or past % 2 or present % 2 or past not in (0, present):
        return None, None
    names = [f"{i // 2}.{'key' if i % 2 == 0 else 'value'}" for i in range(present)]
    return head + [f"past.{n}" for n in names[:past]], ["logits"] + [f"present.{n}" for n in names]


# --- complex-valued nodes ----------------------------------------------------------------------


def _complex_as_real(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """A copy of ``program`` whose complex ``unsqueeze`` runs on a ``view_as_real`` view
    (``[..., 2]`` real pairs) and whose experts' grouped products are ``grouped_rows_mm``.

    The ONNX exporter represents complex tensors as such pairs but has no complex translation
    of ``unsqueeze``, which DeepSeek-V2's complex RoPE (``freqs_cis``) uses; the rewrite is exact
    (the same values, viewed). Other graphs come back unchanged.
    """
    # A new program (weights shared, not copied), the experts' grouped products decomposed.
    program = program.run_decompositions(experts_decompositions(aten_grouped_mm=True))
    graph = program.graph_module.graph
    aten = torch.ops.aten
    changed = False
    for node in list(graph.nodes):
        value = node.meta.get("val")
        if node.target != aten.unsqueeze.default or not value.is_complex():
            continue
        source, dim = node.args
        real_dim = dim if dim >= 0 else dim - 1  # the new trailing pair dimension shifts dim < 0
        with graph.inserting_before(node):
            real = graph.call_function(aten.view_as_real.default, (source,))
            real.meta["val"] = torch.view_as_real(source.meta["val"])
            moved = graph.call_function(aten.unsqueeze.default, (real, real_dim))
            moved.meta["val"] = real.meta["val"].unsqueeze(real_dim)
            back = graph.call_function(aten.view_as_complex.default, (moved,))
            back.meta["val"] = value
        node.replace_all_uses_with(back)
        graph.erase_node(node)
        changed = True
    if changed:
        graph.lint()
        program.graph_module.recompile()
    return program


# --- the export function ----------------------------------------------------------------------


def export_onnx(
    program: torch.export.ExportedProgram,
    path: str | None = None,
    *,
    translation: str = "standard",
    input_names: list[str] | None = None,
    output_names: list[str] | None = None,
):
    """``torch.onnx.export(program, dynamo=True)`` with the ``mla`` ops translated.

    Args:
        program: an exported program (e.g. ``export.export_decode_step(model)``); its dynamic
            dimensions stay dynamic in the ONNX graph.
        path: where to write the ``.onnx`` file (weights inline); ``None`` writes nothing.
        translation: ``"standard"`` (ONNX operators, runs in onnxruntime) or ``"custom"``
            (``com.mla`` nodes, for runtimes with their own MLA kernel).
        input_names, output_names: ONNX names of the flattened inputs / outputs.

    Returns:
        the ``torch.onnx.ONNXProgram`` (``.model_proto``, ``.save``).
    """
    _require_onnxscript()
    if not isinstance(program, torch.export.ExportedProgram):
        raise TypeError(
            "program must be a torch.export.ExportedProgram (e.g. from "
            f"export.export_decode_step), got {type(program).__name__}"
        )
    if translation not in TRANSLATIONS:
        raise ValueError(f"translation must be one of {TRANSLATIONS}, got {translation!r}")
    table = _standard_table() if translation == "standard" else _custom_table()
    if input_names is None and output_names is None:
        input_names, output_names = step_io_names(program)
    with _exporter_notices_quiet():
        onnx_program = torch.onnx.export(
            _complex_as_real(program),
            dynamo=True,
            custom_translation_table=table,
            opset_version=OPSET,
            input_names=input_names,
            output_names=output_names,
            verbose=False,
        )
    if path is not None:
        onnx_program.save(os.fspath(path), external_data=False)
    return onnx_program


@contextlib.contextmanager
def _exporter_notices_quiet():
    """Silence what the exporter says about itself on every export, none of which concerns the
    program: torchvision's ops it skips when torchvision is absent, an empty attribute list's
    type, a pytree deprecation inside torch. Errors and every other warning pass."""
    loggers = [
        logging.getLogger("torch.onnx._internal.exporter._registration"),
        logging.getLogger("onnx_ir._convenience"),
    ]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated"
        )
        try:
            for logger in loggers:
                logger.setLevel(logging.ERROR)
            yield
        finally:
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)


def _tensor_type(dtype):
    import onnx_ir

    return onnx_ir.TensorType(dtype)
