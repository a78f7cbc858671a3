"""Make attention that caches expanded K/V (transformers < 5.15) cache the latent instead.

Such attention computes the new tokens' keys and values from the latent, then hands them to the
cache. With ``MLACache(static=True)`` under ``torch.compile`` that hand-over is the marker op
``mla::expanded_kv_update``; this pass replaces it, for each layer, by::

    rows_new = [latent_new | k_rot_new]                       # [B, S, L+R]
    mla::paged_append(pool, block_table, cache_seqlens, rows_new)
    rows     = mla::paged_rows(pool, block_table, cache_seqlens)  # [B, capacity, L+R]
    kv       = linear(rows[..., :L], W).view(B, capacity, H, P+V).transpose(1, 2)
    keys     = [kv[..., :P] | rows[..., L:].unsqueeze(1).expand(B, H, capacity, R)]
    values   = kv[..., P:]

which is the transformers >= 5.15 (cache-compressed) form: the cache holds L+R values per token
and the projection of the new tokens' K/V becomes dead. ``absorb_mla`` then rewrites decode
attention over it into ``mla_decode`` over the pages, exactly as for transformers >= 5.15.
"""

from __future__ import annotations

import logging
import operator

import torch
from torch._dynamo.utils import counters
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx import Graph, Node

from .graph_ops import kind, meta_value, shape
from .mla_pattern import NotMLA, SkipSite, match_kv

log = logging.getLogger("mla_compile.fx_passes")
aten = torch.ops.aten


def marker_nodes(graph: Graph) -> list[Node]:
    """The ``mla::expanded_kv_update`` calls of ``graph``, in order."""
    return [n for n in graph.nodes if kind(n) == "expanded_kv_update"]


def store_latents(graph: Graph, marker: Node) -> str:
    """Replace one ``mla::expanded_kv_update`` (see the module docstring); returns a
    description. Raises ``NotMLA`` / ``SkipSite`` when the keys do not come from a latent."""
    key_states, value_states, pool, block_table, cache_seqlens = marker.args[:5]
    internal: list[Node] = []
    kv = match_kv(key_states, value_states, internal)
    latent_shape, rot_shape = shape(kv.latent), shape(kv.k_rot)
    if latent_shape is None or rot_shape is None or len(rot_shape) != 4 or rot_shape[1] != 1:
        raise SkipSite("no shape information on the new latent or rope key")
    kv_lora_rank = latent_shape[-1]
    row_width = shape(pool)[-1]
    if row_width != kv_lora_rank + kv.rope_dim:
        raise SkipSite(
            f"the cache row holds {row_width} values, the latent and rope key "
            f"{kv_lora_rank}+{kv.rope_dim}"
        )
    capacity = shape(block_table)[1] * shape(pool)[1]
    heads, head_dim = kv.heads, kv.nope_dim + kv.v_dim
    getitems = {user.args[1]: user for user in marker.users if kind(user) == "getitem"}
    if set(getitems) != {0, 1} or len(marker.users) != 2:
        raise SkipSite("the cache update's outputs are used in an unexpected way")

    emit = _Emitter(graph, marker)
    latent = kv.latent if len(latent_shape) == 3 else emit(aten.select.int, kv.latent, 1, 0)
    k_rot_new = emit(aten.select.int, kv.k_rot, 1, 0)  # [B, S, R]
    rows_new = emit(aten.cat.default, [latent, k_rot_new], -1)  # [B, S, L+R]
    emit(torch.ops.mla.paged_append.default, pool, block_table, cache_seqlens, rows_new)
    rows = emit(torch.ops.mla.paged_rows.default, pool, block_table, cache_seqlens)
    latent_all = emit(aten.slice.Tensor, rows, -1, 0, kv_lora_rank)  # [B, capacity, L]
    rope_all = emit(aten.slice.Tensor, rows, -1, kv_lora_rank, row_width)  # [B, capacity, R]
    rope_all = emit(aten.unsqueeze.default, rope_all, 1)  # [B, 1, capacity, R]
    projected = emit(aten.linear.default, latent_all, kv.weight)  # [B, capacity, H*(P+V)]
    per_head = emit(aten.view.default, projected, [-1, capacity, heads, head_dim])
    per_head = emit(aten.transpose.int, per_head, 1, 2)  # [B, H, capacity, P+V]
    parts = emit(aten.split_with_sizes.default, per_head, [kv.nope_dim, kv.v_dim], -1)
    k_nope, values = emit(operator.getitem, parts, 0), emit(operator.getitem, parts, 1)
    rope_heads = emit(aten.expand.default, rope_all, [-1, heads, -1, -1])
    keys = emit(aten.cat.default, [k_nope, rope_heads], -1)  # [B, H, capacity, P+R]

    getitems[0].replace_all_uses_with(keys)
    getitems[1].replace_all_uses_with(values)
    for node in (getitems[0], getitems[1], marker):
        graph.erase_node(node)
    order = {node: i for i, node in enumerate(graph.nodes)}
    for node in sorted(set(internal), key=order.__getitem__, reverse=True):
        if not node.users:  # the new tokens' own K/V expansion
            graph.erase_node(node)
    return (
        f"cache update '{marker.name}': stores [latent | k_rot] rows (L={kv_lora_rank}, "
        f"R={kv.rope_dim}) instead of H={heads} x (P+R+V) values per token"
    )


def rewrite_cache_updates(graph: Graph) -> list[tuple[str, str, str]]:
    """``store_latents`` on every marker; returns ``(node, status, reason)`` per marker."""
    done = []
    for marker in marker_nodes(graph):
        try:
            what = store_latents(graph, marker)
        except (NotMLA, SkipSite) as why:
            done.append((marker.name, "skipped", f"cache update kept: {why}"))
            log.info("fx_passes: kept cache update '%s': %s", marker.name, why)
            continue
        counters["mla"]["latent_cache_updates"] += 1
        done.append((marker.name, "latent-cache", what))
        log.info("fx_passes: %s", what)
    return done


class _Emitter:
    """Inserts calls before ``anchor`` and gives each the fake value later matching reads."""

    def __init__(self, graph: Graph, anchor: Node) -> None:
        self.graph, self.anchor = graph, anchor
        self.key = "val" if "val" in anchor.meta else "example_value"

    def __call__(self, target, *args) -> Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(target, args)
        values = torch.fx.node.map_arg(args, meta_value)
        fakes = [v for v in torch.utils._pytree.tree_leaves(values) if isinstance(v, FakeTensor)]
        with fakes[0].fake_mode:
            node.meta[self.key] = target(*values)
        return node
