"""Find Multi-head Latent Attention in an FX graph by its structure.

An MLA site is attention (SDPA, or eager matmul -> scale -> [+ mask] -> softmax -> matmul) whose
keys and values both come from one ``kv_b_proj`` linear over the latent::

    kv   = linear(latent [B, (1,) T, L], W [H*(P+V), L])        # no bias
    kv   = kv.view(B, T, H, P+V).transpose(1, 2)                 # [B, H, T, P+V]
    k_nope, value = kv[..., :P], kv[..., P:]                     # split or slices
    key  = [k_nope | k_rot.expand(B, H, T, R)]                   # cat, or new_empty + 2 copy_
                                                                 # or 2 slice assignments
    out  = attention(query [B, H, S, P+R], key, value, mask, scale)   # [B, H, S, V]

Eager attention may also take a learned sink logit per head into its softmax (hy_v4:
``softmax(cat([scores, sink]))[..., :-1]``, with or without the max subtracted first); the
absorbed form then scales each row by ``sigmoid(lse - sink)``, the weight its tokens keep.

Nothing is matched by module or class name, so every Hugging Face MLA family (and the same math
written by hand) is found. ``match_site`` returns an ``MLASite`` or raises ``NotMLA`` (ordinary
attention: ignored) or ``SkipSite`` (MLA that cannot be rewritten safely, with the reason).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch.fx import Node

from .graph_ops import (
    constant_float,
    dtype,
    kind,
    last_dim_range,
    named_arg,
    normalize_dim,
    setitem_last_dim_range,
    shape,
)


class NotMLA(Exception):
    """The attention is not MLA (its keys/values do not come from a latent projection)."""


class SkipSite(Exception):
    """MLA attention that is left as it is; the message says why."""


@dataclass
class MLASite:
    """One MLA attention site and everything the absorbed form needs from it."""

    attention: Node  # node whose output [B, H, S, V] the rewrite replaces
    query: Node  # [B, H, S, P+R]
    latent: Node  # kv_b_proj input: [B, 1, T, L] or [B, T, L]
    k_rot: Node  # shared rope key: [B, 1, T, R]
    weight: Node  # kv_b_proj weight [H*(P+V), L]
    attn_mask: Node | None  # [B|1, 1, S|1, T], bool or additive float
    softmax_scale: float
    heads: int
    nope_dim: int  # P
    rope_dim: int  # R
    v_dim: int  # V
    kv_lora_rank: int  # L
    q_len: object  # S (int, or a SymInt in a dynamic graph)
    form: str  # "sdpa" or "eager"
    internal: list[Node] = field(default_factory=list)  # nodes that die with the rewrite
    sink: Node | None = None  # [B, H, S, 1] a sink logit per head in the softmax (eager only)

    def describe(self) -> str:
        return (
            f"{self.form} attention '{self.attention.name}': H={self.heads} L={self.kv_lora_rank} "
            f"R={self.rope_dim} P={self.nope_dim} V={self.v_dim} S_q={self.q_len} "
            f"scale={self.softmax_scale:.6g} mask={'yes' if self.attn_mask is not None else 'no'}"
            + (" sink=yes" if self.sink is not None else "")
        )


def attention_candidates(graph: torch.fx.Graph) -> list[Node]:
    """SDPA nodes and softmax nodes (the core of eager attention), in graph order."""
    return [n for n in graph.nodes if kind(n) in ("sdpa", "softmax")]


def _single_user(node: Node) -> Node | None:
    users = [u for u in node.users if kind(u) != "assert_meta"]
    return users[0] if len(users) == 1 else None


def _strip(node: Node, internal: list[Node]) -> Node:
    """Skip ``contiguous()`` calls, which change no value."""
    while kind(node) == "contiguous" and len(node.args) >= 1:
        internal.append(node)
        node = node.args[0]
    return node


def _strip_sink(logits: Node, internal: list[Node]) -> tuple[Node, Node | None]:
    """``(scores, sink)`` of softmax logits ``[cat([scores, sink], -1) [- their max]]``: the
    max subtracted for stability changes no probability (it is stripped with or without a
    sink), and ``sink`` ``[B, H, S, 1]`` is a logit per head that only takes weight away from
    the tokens; ``sink`` is None where there is none."""
    node = logits
    if kind(node) == "sub" and len(node.args) == 2:
        shifted, peak = node.args
        if kind(peak) == "getitem" and peak.args[1] == 0:
            peak = peak.args[0]
        last = normalize_dim(named_arg(peak, "dim", None), 4) if kind(peak) == "max" else None
        if last == 3 and named_arg(peak, "keepdim", False) and named_arg(peak, "input") is shifted:
            internal += [node, peak] + [u for u in peak.users if kind(u) == "getitem"]
            node = shifted
    if kind(node) != "cat" or normalize_dim(named_arg(node, "dim", 0), 4) != 3:
        return node, None
    parts = named_arg(node, "tensors")
    if not isinstance(parts, (list, tuple)) or len(parts) != 2:
        return node, None
    scores, sink = parts
    sink_shape = shape(sink)
    if sink_shape is None or len(sink_shape) != 4 or sink_shape[-1] != 1:
        return node, None
    internal.append(node)
    return scores, sink


def _drops_last_column(node: Node) -> bool:
    """``node`` is ``probs[..., :-1]`` (the sink's column dropped)."""
    if kind(node) == "getitem":
        index = node.args[1]
        return (
            isinstance(index, tuple)
            and len(index) == 2
            and index[0] is Ellipsis
            and index[1] == slice(None, -1, None)
        )
    if kind(node) == "slice":
        width = (shape(named_arg(node, "input")) or (None,))[-1]
        end = named_arg(node, "end", None)
        return (
            normalize_dim(named_arg(node, "dim", 0), 4) == 3
            and named_arg(node, "start", 0) in (0, None)
            and (end == -1 or (width is not None and end == width - 1))
            and named_arg(node, "step", 1) in (1, None)
        )
    return False


def _parse_eager(
    softmax: Node,
) -> tuple[Node, Node, Node, Node | None, float, Node, list[Node], Node | None]:
    """``(query, key, value, mask, scale, output, internal, sink)`` of eager attention around
    softmax."""
    internal = [softmax]
    if normalize_dim(named_arg(softmax, "dim", None), 4) != 3:
        raise NotMLA("softmax is not over the last dimension of a 4-D tensor")
    logits, sink = _strip_sink(named_arg(softmax, "input"), internal)
    # Forward: [probs[..., :-1] with a sink] -> [to(dtype)] -> [dropout(p=0)] -> matmul(probs, v)
    node = softmax
    if sink is not None:
        user = _single_user(node)
        if user is None or not _drops_last_column(user):
            raise NotMLA("softmax over a sink column is not followed by dropping that column")
        internal.append(user)
        node = user
    while True:
        user = _single_user(node)
        if user is None:
            raise NotMLA("softmax output has several users (attention weights returned?)")
        if kind(user) == "to":
            internal.append(user)
            node = user
            continue
        if kind(user) == "dropout":
            p = named_arg(user, "p", 0.5)
            training = named_arg(user, "training", True)
            if p != 0.0 and training is not False:
                raise NotMLA("attention dropout is active")
            internal.append(user)
            node = user
            continue
        break
    if kind(user) != "matmul" or user.args[0] is not node:
        raise NotMLA("softmax does not feed a matmul with the values")
    output, value = user, user.args[1]
    # Backward: [add(mask)] <- mul/div(scale) <- matmul(query, key^T)
    scores = logits
    mask = None
    if kind(scores) == "add":
        internal.append(scores)
        a, b = scores.args[0], scores.args[1]
        scores, mask = (a, b) if kind(a) in ("mul", "div", "matmul") else (b, a)
    scale = 1.0
    if kind(scores) in ("mul", "div"):
        internal.append(scores)
        a, b = scores.args[0], scores.args[1]
        factor = constant_float(b) if isinstance(a, Node) else constant_float(a)
        product = a if isinstance(a, Node) else b
        if factor is None or not isinstance(product, Node):
            raise SkipSite("the softmax scale is not a constant")
        scale = factor if kind(scores) == "mul" else 1.0 / factor
        scores = product
    if kind(scores) != "matmul":
        raise NotMLA("scores are not a matmul")
    internal.append(scores)
    query, key_t = scores.args[0], scores.args[1]
    if kind(key_t) != "transpose":
        raise NotMLA("scores do not multiply by a transposed key")
    dims = {normalize_dim(named_arg(key_t, "dim0"), 4), normalize_dim(named_arg(key_t, "dim1"), 4)}
    if dims != {2, 3}:
        raise NotMLA("key is not transposed over its last two dimensions")
    internal.append(key_t)
    internal.append(output)
    return query, key_t.args[0], value, mask, scale, output, internal, sink


def _parse_sdpa(sdpa: Node) -> tuple[Node, Node, Node, Node | None, float | None, Node, list]:
    if named_arg(sdpa, "dropout_p", 0.0) not in (0, 0.0):
        raise NotMLA("SDPA dropout is active")
    if named_arg(sdpa, "enable_gqa", False):
        raise NotMLA("SDPA with enable_gqa")
    if named_arg(sdpa, "is_causal", False) is not False:
        raise SkipSite("is_causal=True SDPA (the prefill form, top-left aligned): kept")
    scale = named_arg(sdpa, "scale", None)
    if scale is not None and constant_float(scale) is None:
        raise SkipSite("the SDPA scale is not a constant")
    return (
        named_arg(sdpa, "query"),
        named_arg(sdpa, "key"),
        named_arg(sdpa, "value"),
        named_arg(sdpa, "attn_mask", None),
        None if scale is None else constant_float(scale),
        sdpa,
        [sdpa],
    )


def _kv_projection(x: Node, internal: list[Node]) -> tuple[Node, Node, int, int]:
    """``x = linear(latent, W).view(B, T, H, D).transpose(1, 2)``: ``(latent, W, H, D)``."""
    if kind(x) != "transpose":
        raise NotMLA("keys/values are not a transposed per-head view")
    dims = {normalize_dim(named_arg(x, "dim0"), 4), normalize_dim(named_arg(x, "dim1"), 4)}
    view = x.args[0]
    if dims != {1, 2} or kind(view) != "view":
        raise NotMLA("keys/values are not view(B, T, H, D).transpose(1, 2)")
    projected = view.args[0]
    if kind(projected) != "linear":
        raise NotMLA("keys/values do not come from a linear projection")
    view_shape, proj_shape = shape(view), shape(projected)
    if view_shape is None or proj_shape is None or len(view_shape) != 4:
        raise NotMLA("no shape information on the key/value projection")
    heads, head_dim = view_shape[2], view_shape[3]
    if not isinstance(heads, int) or not isinstance(head_dim, int):
        raise SkipSite("symbolic head count or head size")
    if proj_shape[-1] != heads * head_dim:
        raise NotMLA("the per-head view does not split the projection's last dimension")
    if named_arg(projected, "bias", None) is not None:
        raise SkipSite("kv_b_proj has a bias")
    latent, weight = named_arg(projected, "input"), named_arg(projected, "weight")
    internal.extend([x, view, projected])
    return latent, weight, heads, head_dim


def _key_parts(key: Node, internal: list[Node]) -> dict[tuple[int, int], Node]:
    """``{(start, end): source}`` of the key's last-dimension pieces."""
    if kind(key) == "cat":
        tensors = named_arg(key, "tensors")
        key_shape = shape(key)
        dim = named_arg(key, "dim", 0)
        if key_shape is None or normalize_dim(dim, len(key_shape)) != len(key_shape) - 1:
            raise NotMLA("key is not concatenated along the head dimension")
        parts, start = {}, 0
        for t in tensors:
            width = shape(t)[-1] if shape(t) is not None else None
            if not isinstance(width, int):
                raise NotMLA("key piece without a static width")
            parts[(start, start + width)] = t
            start += width
        internal.append(key)
        return parts
    if kind(key) == "new_empty":
        parts = {}
        internal.append(key)
        for user in key.users:
            assigned = setitem_last_dim_range(user)
            if assigned is not None and assigned[0] is key:  # key[..., a:b] = piece
                parts[(assigned[1], assigned[2])] = assigned[3]
                internal.append(user)
                continue
            piece = last_dim_range(user)
            if piece is None or piece[0] is not key:
                continue  # the attention (or the eager transpose) reading the whole key
            writers = [u for u in user.users if kind(u) == "copy_" and u.args[0] is user]
            if len(writers) != 1 or len(user.users) != 1:
                raise SkipSite("the key buffer is written in an unexpected way")
            parts[(piece[1], piece[2])] = named_arg(writers[0], "src")
            internal.extend([user, writers[0]])
        return parts
    raise NotMLA("key is neither a concatenation nor a filled buffer")


@dataclass
class KVSource:
    """Keys and values computed from a latent: ``kv_b_proj`` and the shared rope key."""

    latent: Node  # kv_b_proj input: [B, 1, T, L] or [B, T, L]
    weight: Node  # kv_b_proj weight [H*(P+V), L]
    k_rot: Node  # shared rope key [B, 1, T, R]
    heads: int
    nope_dim: int  # P
    rope_dim: int  # R
    v_dim: int  # V


def match_kv(key: Node, value: Node, internal: list[Node]) -> KVSource:
    """How MLA keys ``[k_nope | k_rot.expand]`` and values came from one latent projection;
    raises ``NotMLA`` / ``SkipSite``. The nodes in between are appended to ``internal``."""
    value = _strip(value, internal)
    key = _strip(key, internal)

    v_piece = last_dim_range(value)
    if v_piece is None:
        raise NotMLA("values are not a slice of a projection")
    x, v_start, v_end = v_piece
    internal.append(value)
    if kind(value) == "getitem" and kind(value.args[0]) == "split":
        internal.append(value.args[0])
    latent, weight, heads, head_dim = _kv_projection(x, internal)

    parts = _key_parts(key, internal)
    if len(parts) != 2:
        raise NotMLA(f"key has {len(parts)} pieces, expected nope + rope")
    (nope_range, nope_src), (rope_range, rope_src) = sorted(parts.items())
    nope_src = _strip(nope_src, internal)
    nope_piece = last_dim_range(nope_src)
    if nope_piece is None or nope_piece[0] is not x or nope_piece[1:] != nope_range:
        raise NotMLA("the key's first piece is not the projection's nope part")
    internal.append(nope_src)
    nope_dim = nope_range[1]
    if nope_range[0] != 0 or (v_start, v_end) != (nope_dim, head_dim):
        raise NotMLA("projection is not [k_nope | value] per head")
    v_dim = head_dim - nope_dim

    # The rope part: one head shared by all (MQA), broadcast with expand.
    k_rot = rope_src
    if kind(rope_src) == "expand":
        internal.append(rope_src)
        k_rot = named_arg(rope_src, "input")
    rope_dim = rope_range[1] - rope_range[0]
    rot_shape = shape(k_rot)
    if rope_range[0] != nope_dim or rot_shape is None or rot_shape[-1] != rope_dim:
        raise NotMLA("the key's second piece is not the rope part")
    return KVSource(latent, weight, k_rot, heads, nope_dim, rope_dim, v_dim)


def match_site(candidate: Node) -> MLASite:
    """The MLA site at an SDPA or softmax node; raises ``NotMLA`` or ``SkipSite``."""
    sink = None
    if kind(candidate) == "sdpa":
        form = "sdpa"
        query, key, value, mask, scale, output, internal = _parse_sdpa(candidate)
    else:
        form = "eager"
        query, key, value, mask, scale, output, internal, sink = _parse_eager(candidate)
    kv = match_kv(key, value, internal)
    latent, weight, heads, k_rot = kv.latent, kv.weight, kv.heads, kv.k_rot
    nope_dim, rope_dim, v_dim = kv.nope_dim, kv.rope_dim, kv.v_dim
    rot_shape, q_shape, lat_shape = shape(k_rot), shape(query), shape(latent)
    if rot_shape is None or q_shape is None or lat_shape is None:
        raise SkipSite("no shape information on the query or the rope key")
    if len(rot_shape) != 4 or rot_shape[1] != 1:
        raise SkipSite(f"the rope key {rot_shape} is not one head shared by all heads")
    if len(q_shape) != 4 or q_shape[1] != heads or q_shape[-1] != nope_dim + rope_dim:
        raise SkipSite(f"query {q_shape} is not [B, H={heads}, S, P+R={nope_dim + rope_dim}]")
    kv_lora_rank = lat_shape[-1]
    if len(lat_shape) == 4 and lat_shape[1] != 1:
        raise SkipSite(f"latent {lat_shape} is not [B, 1, T, L] or [B, T, L]")
    if len({dtype(query), dtype(latent), dtype(k_rot)}) != 1:
        raise SkipSite(
            f"query, latent and rope key dtypes differ: {dtype(query)}, {dtype(latent)}, "
            f"{dtype(k_rot)}"
        )

    if mask is not None:
        m_shape = shape(mask)
        if m_shape is None or len(m_shape) != 4 or (m_shape[1] != 1 and heads != 1):
            raise SkipSite(f"mask {m_shape} is not [B, 1, S, T] (one mask shared by the heads)")
    if sink is not None:
        sink_shape = shape(sink)
        if sink_shape[1] != heads or sink_shape[2] not in (1, q_shape[2]):
            raise SkipSite(f"sink logits {sink_shape} are not [B, H={heads}, S, 1]")
    if scale is None:
        scale = (nope_dim + rope_dim) ** -0.5
    site = MLASite(
        attention=output,
        query=query,
        latent=latent,
        k_rot=k_rot,
        weight=weight,
        attn_mask=mask,
        softmax_scale=scale,
        heads=heads,
        nope_dim=nope_dim,
        rope_dim=rope_dim,
        v_dim=v_dim,
        kv_lora_rank=kv_lora_rank,
        q_len=q_shape[2],
        form=form,
        internal=list(dict.fromkeys(internal)),
        sink=sink,
    )
    # export's metadata assertions on intermediates die with them
    site.internal += [u for n in site.internal for u in n.users if kind(u) == "assert_meta"]
    _check_private(site)
    _check_not_mutated_after_read(site)
    return site


# Methods and functions that return a view of their first argument (writes through them reach
# it), and those that write their first argument in place.
_VIEW_METHODS = frozenset({
    "view", "view_as", "reshape", "reshape_as", "transpose", "permute", "unsqueeze", "squeeze",
    "expand", "expand_as", "narrow", "select", "contiguous", "flatten", "unflatten", "split",
    "chunk", "unbind", "t", "as_strided", "detach", "__getitem__", "to", "type_as", "movedim",
})  # fmt: skip
_INPLACE_FUNCTIONS = frozenset({
    operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
    operator.ipow, operator.iand, operator.ior,
})  # fmt: skip


def _returns_view(node: Node) -> bool:
    if node.op == "call_method":
        return node.target in _VIEW_METHODS
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)  # an ATen overload: its alias annotations
    if schema is not None:
        return (
            bool(schema.returns)
            and schema.returns[0].alias_info is not None
            and not (schema.returns[0].alias_info.is_write)
        )
    name = getattr(node.target, "__name__", "")
    return name in _VIEW_METHODS and getattr(node.target, "__module__", "") in ("torch", None)


def _writes_first_argument(node: Node) -> bool:
    if node.op == "call_method":
        name = str(node.target)
        return name.endswith("_") and not name.startswith("_")
    if node.op != "call_function":
        return False
    if node.target in _INPLACE_FUNCTIONS:
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is not None and schema.arguments:
        alias = schema.arguments[0].alias_info
        return alias is not None and alias.is_write
    name = getattr(node.target, "__name__", "")
    return name.endswith("_") and not name.startswith("_")


def _aliases(node: Node) -> set[Node]:
    """``node``, the tensor it is a view of, and every view of that tensor in the graph."""
    root = node
    while _returns_view(root) and root.args and isinstance(root.args[0], Node):
        root = root.args[0]
    found, todo = {root}, [root]
    while todo:
        for user in todo.pop().users:
            if user not in found and _returns_view(user) and user.args and user.args[0] in found:
                found.add(user)
                todo.append(user)
    return found


def _check_not_mutated_after_read(site: MLASite) -> None:
    """The absorbed form reads the latent, the projection's weight and the rope key at the
    attention, where the original read them earlier (at ``kv_b_proj`` and where the key was
    built): an in-place write in between would reach the rewrite but not the original."""
    order = {node: index for index, node in enumerate(site.attention.graph.nodes)}
    projection = next(n for n in site.internal if kind(n) == "linear")
    key_built = min(
        (n for n in site.internal if kind(n) in ("cat", "copy_", "setitem")), key=order.get,
        default=projection,
    )  # fmt: skip
    stop = order[site.attention]
    for what, source, read in (
        ("the latent (kv_b_proj's input)", site.latent, projection),
        ("kv_b_proj's weight", site.weight, projection),
        ("the rope key", site.k_rot, key_built),
    ):
        if not isinstance(source, Node):
            continue
        for alias in _aliases(source):
            for user in alias.users:
                if (
                    _writes_first_argument(user)
                    and user.args
                    and user.args[0] is alias
                    and order[read] < order[user] < stop
                    and user not in site.internal
                ):
                    raise SkipSite(
                        f"{what} is modified in place ('{user.name}') after the original reads "
                        "it and before the attention: the absorbed form would read the new value"
                    )


def _check_private(site: MLASite) -> None:
    """Every intermediate between kv_b_proj and the attention output must die with the site."""
    inside = set(site.internal)
    for node in site.internal:
        if node is site.attention:
            continue
        for user in node.users:
            if user not in inside:
                if kind(node) in (
                    "softmax", "matmul", "mul", "div", "add", "to", "dropout", "sub", "max", "cat"
                ):  # fmt: skip
                    what = "attention weights"
                else:
                    what = "kv_b_proj output"
                raise SkipSite(f"{what} also used elsewhere ('{node.name}' by '{user.name}')")


__all__ = [
    "KVSource",
    "MLASite",
    "NotMLA",
    "SkipSite",
    "attention_candidates",
    "match_kv",
    "match_site",
]
