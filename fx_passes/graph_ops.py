"""Which tensor operation an FX node performs, whatever level the graph was captured at.

Dynamo graphs call torch functions and tensor methods (``torch._C._nn.linear``, ``x.view``),
``torch.export`` graphs call ATen overloads (``aten.linear.default``, ``aten.view.default``). The
MLA matcher asks one question, ``kind(node)``, and reads arguments through ``arg`` so that it
works on both.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import Node

from mla_compile import mla_ops  # noqa: F401  (registers torch.ops.mla.*, matched below)

aten = torch.ops.aten

# kind -> (call_function targets, call_method names)
_KINDS: dict[str, tuple[tuple[Any, ...], tuple[str, ...]]] = {
    "linear": ((torch._C._nn.linear, F.linear, aten.linear.default), ()),
    "sdpa": (
        (
            torch._C._nn.scaled_dot_product_attention,
            F.scaled_dot_product_attention,
            aten.scaled_dot_product_attention.default,
        ),
        (),
    ),
    "matmul": ((torch.matmul, operator.matmul, aten.matmul.default), ("matmul", "__matmul__")),
    "view": (
        (torch.reshape, aten.view.default, aten.reshape.default, aten._unsafe_view.default),
        ("view", "reshape"),
    ),
    "transpose": ((torch.transpose, aten.transpose.int), ("transpose",)),
    "split": (
        (torch.split, torch.functional.split, aten.split.Tensor, aten.split_with_sizes.default),
        ("split",),
    ),
    "getitem": ((operator.getitem,), ()),
    "slice": ((aten.slice.Tensor,), ()),
    "cat": ((torch.cat, torch.concat, torch.concatenate, aten.cat.default), ()),
    "expand": ((aten.expand.default,), ("expand",)),
    "unsqueeze": ((torch.unsqueeze, aten.unsqueeze.default), ("unsqueeze",)),
    # a paged latent cache's rows in token order (mla_ops.paged_cache, static mode)
    "paged_rows": ((torch.ops.mla.paged_rows, torch.ops.mla.paged_rows.default), ()),
    # every rank's rows of a cache sharded by token (mla_ops.context_parallel, MLACache's
    # context_parallel)
    "cp_rows": ((torch.ops.mla.cp_rows, torch.ops.mla.cp_rows.default), ()),
    # what MLACache receives from attention that caches expanded K/V (transformers < 5.15)
    "expanded_kv_update": (
        (torch.ops.mla.expanded_kv_update, torch.ops.mla.expanded_kv_update.default),
        (),
    ),
    "new_empty": ((aten.new_empty.default,), ("new_empty",)),
    "copy_": ((aten.copy_.default,), ("copy_",)),
    "setitem": ((operator.setitem,), ()),  # x[..., a:b] = y in a dynamo graph
    "softmax": (
        (F.softmax, torch.softmax, aten.softmax.int, aten._softmax.default),
        ("softmax",),
    ),
    "mul": ((operator.mul, torch.mul, aten.mul.Tensor, aten.mul.Scalar), ("mul",)),
    "div": ((operator.truediv, torch.div, aten.div.Tensor, aten.div.Scalar), ("div",)),
    "add": ((operator.add, torch.add, aten.add.Tensor), ("add",)),
    "sub": ((operator.sub, torch.sub, aten.sub.Tensor), ("sub",)),
    "max": ((torch.max, torch.amax, aten.max.dim, aten.amax.default), ("max", "amax")),
    "to": ((aten.to.dtype, aten._to_copy.default), ("to", "type")),
    "dropout": ((F.dropout, torch.dropout, aten.dropout.default), ()),
    "contiguous": ((aten.contiguous.default, aten.clone.default), ("contiguous",)),
    # export's runtime dtype/device assertions: they read a value but compute nothing
    "assert_meta": ((aten._assert_tensor_metadata.default,), ()),
}

# Positional parameter names, for reading arguments given either way.
_PARAMS: dict[str, tuple[str, ...]] = {
    "linear": ("input", "weight", "bias"),
    "sdpa": (
        "query",
        "key",
        "value",
        "attn_mask",
        "dropout_p",
        "is_causal",
        "scale",
        "enable_gqa",
    ),
    "split": ("tensor", "split_size_or_sections", "dim"),
    "transpose": ("input", "dim0", "dim1"),
    "softmax": ("input", "dim", "dtype"),
    "dropout": ("input", "p", "training"),
    "cat": ("tensors", "dim"),
    "max": ("input", "dim", "keepdim"),
    "slice": ("input", "dim", "start", "end", "step"),
    "expand": ("input", "size"),
    "copy_": ("self", "src"),
    "unsqueeze": ("input", "dim"),
    "paged_rows": ("pool", "block_table", "cache_seqlens"),
    "cp_rows": (
        "pool",
        "block_table",
        "local_seqlens",
        "group_name",
        "world",
        "rank",
        "interleave",
        "capacity",
        "heads_sharded",
    ),
}


def kind(node: Any) -> str | None:
    """The operation ``node`` performs (``"linear"``, ``"sdpa"``, ...), or None."""
    if not isinstance(node, Node):
        return None
    for name, (functions, methods) in _KINDS.items():
        if node.op == "call_function" and node.target in functions:
            return name
        if node.op == "call_method" and node.target in methods:
            return name
    return None


def arg(node: Node, index: int, name: str, default: Any = None) -> Any:
    """Argument ``index`` (positional) or ``name`` (keyword) of ``node``.

    For a method call, index 0 is the tensor the method is called on.
    """
    if index < len(node.args):
        return node.args[index]
    return node.kwargs.get(name, default)


def named_arg(node: Node, name: str, default: Any = None) -> Any:
    """Argument ``name`` of a node whose kind has a known parameter list."""
    params = _PARAMS[kind(node)]
    return arg(node, params.index(name), name, default)


def meta_value(node: Any) -> Any:
    """The fake value of ``node`` (``val`` in export graphs, ``example_value`` in dynamo)."""
    if not isinstance(node, Node):
        return None
    if "val" in node.meta:
        return node.meta["val"]
    return node.meta.get("example_value")


def shape(node: Any) -> tuple | None:
    value = meta_value(node)
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def dtype(node: Any) -> torch.dtype | None:
    value = meta_value(node)
    return value.dtype if isinstance(value, torch.Tensor) else None


def normalize_dim(dim: Any, ndim: int) -> int | None:
    if not isinstance(dim, int):
        return None
    return dim + ndim if dim < 0 else dim


def last_dim_range(node: Node) -> tuple[Node, int, int] | None:
    """``(source, start, end)`` if ``node`` takes a range of ``source``'s last dimension.

    Recognised: an item of ``split`` along the last dimension, ``aten.slice`` on it, and
    ``source[..., a:b]`` indexing.
    """
    if kind(node) != "getitem":
        if kind(node) == "slice":
            source = named_arg(node, "input")
            src_shape = shape(source)
            if src_shape is None:
                return None
            if normalize_dim(named_arg(node, "dim", 0), len(src_shape)) != len(src_shape) - 1:
                return None
            if named_arg(node, "step", 1) not in (1, None):
                return None
            width = src_shape[-1]
            start, end = named_arg(node, "start", 0) or 0, named_arg(node, "end", None)
            end = width if end is None or (isinstance(end, int) and end > width) else end
            return (source, start, end) if isinstance(start, int) and isinstance(end, int) else None
        return None
    source, index = node.args
    if kind(source) == "split" and isinstance(index, int):
        tensor = named_arg(source, "tensor")
        src_shape = shape(tensor)
        sizes = named_arg(source, "split_size_or_sections")
        dim = named_arg(source, "dim", 0)
        if src_shape is None or normalize_dim(dim, len(src_shape)) != len(src_shape) - 1:
            return None
        if isinstance(sizes, int):
            start = index * sizes
            return tensor, start, min(start + sizes, src_shape[-1])
        if isinstance(sizes, (list, tuple)) and all(isinstance(s, int) for s in sizes):
            return tensor, sum(sizes[:index]), sum(sizes[: index + 1])
        return None
    # source[..., a:b]
    if isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis:
        sl = index[1]
        src_shape = shape(source)
        if isinstance(sl, slice) and sl.step in (None, 1) and src_shape is not None:
            width = src_shape[-1]
            start = 0 if sl.start is None else sl.start
            end = width if sl.stop is None else min(sl.stop, width)
            if isinstance(start, int) and isinstance(end, int):
                return source, start, end
    return None


def setitem_last_dim_range(node: Node) -> tuple[Node, int, int, Any] | None:
    """``(target, start, end, value)`` of ``target[..., start:end] = value`` (also spelled
    ``target[:, :, :, start:end]``), else None."""
    if kind(node) != "setitem" or len(node.args) != 3:
        return None
    target, index, value = node.args
    target_shape = shape(target)
    if target_shape is None or not isinstance(index, tuple) or not index:
        return None
    *leading, last = index
    full = slice(None, None, None)
    if leading == [Ellipsis]:
        pass
    elif len(index) != len(target_shape) or any(i != full for i in leading):
        return None
    if not isinstance(last, slice) or last.step not in (None, 1):
        return None
    width = target_shape[-1]
    start = 0 if last.start is None else last.start
    end = width if last.stop is None else min(last.stop, width)
    if not (isinstance(start, int) and isinstance(end, int)):
        return None
    return target, start, end, value


def constant_float(value: Any) -> float | None:
    """A Python number (a scale baked into the graph), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    return None
