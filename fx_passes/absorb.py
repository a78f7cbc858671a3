"""``absorb_mla``: rewrite MLA attention in an FX graph into the absorbed, cache-compressed form.

For each site found by ``mla_pattern.match_site`` (decode-sized query, see ``max_q_len``) the
attention output is replaced by ``absorbed_mla_attention(query, latent, k_rot, kv_b_weight, ...)``:

    q_lat = q_nope @ W_UK                 # [B, S, H, L]   (W_UK, W_UV: views of the live weight)
    o_lat = MQA over [kv_c | k_pe]        # mla_ops.mla_decode: the latent is read once, never
                                          # expanded to per-head K/V
    out   = o_lat @ W_UV^T                # [B, H, S, V], what the attention returned before

and the ``kv_b_proj`` expansion, the key buffer and the attention become dead and are removed.

Cost rule (prefill vs decode): per query token the absorbed form costs ``2 H T (2L + R)`` FLOPs
over the cache, the original ``2 H T (P + R + V)`` plus a one-off ``2 T L H (P + V)`` expansion
shared by all S query tokens. Decode (small S) is dominated by the expansion and by reading
``H (P + V)`` values per cached token instead of ``L + R``: the absorbed form wins by an order of
magnitude. Prefill amortises the expansion and its attention is one dense fused kernel, so the
un-absorbed form stays, computed by ``mla::prefill`` a chunk of keys at a time over the latent
(``chunked_mla_prefill``): the original expanded every cached token at once. The rule: absorb when
``S <= max_q_len`` (default 8, the multi-token-prediction range our decode kernel serves); longer
or symbolic S is prefill: ``mla::prefill`` where the original's whole expansion would pass
``prefill_original_bytes`` (1 GiB) or its shapes are symbolic, the original form below that,
where it is faster (``RewriteOptions(prefill="original")`` leaves every prefill as written).

Observability: ``torch._dynamo.utils.counters["mla"]`` counts ``absorbed_sites`` (decode),
``prefill_sites`` (``mla::prefill``), ``kept_sites`` (prefill left as written) and
``skipped_sites`` (an MLA site the rewrite cannot take safely, e.g. one whose inputs are modified
in place: each is worth a look); the ``fx_passes`` logger (standard ``logging``, silent by
default) reports each site found, rewritten, kept or skipped with the reason at INFO;
``absorb_mla`` returns an ``AbsorbReport``.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch
from torch._dynamo.utils import counters
from torch.fx import GraphModule, Node

from mla_compile.mla_ops import mla_decode
from mla_compile.mla_ops.context_parallel import (
    gather_heads,
    group_heads,
    local_mask_columns,
    merge_across,
)
from mla_compile.mla_ops.prefill import DEFAULT_CHUNK_BYTES

from .graph_ops import kind, last_dim_range, meta_value, named_arg, shape
from .latent_cache import rewrite_cache_updates
from .mla_pattern import MLASite, NotMLA, SkipSite, attention_candidates, match_site

log = logging.getLogger("mla_compile.fx_passes")

DEFAULT_MAX_Q_LEN = 8
PREFILL_FORMS = ("chunked", "original")


@dataclass(frozen=True)
class RewriteOptions:
    """What ``absorb_mla`` (and the backends made by ``fx_passes.backend.mla_backend``) do.

    max_q_len: sites with at most this many query tokens are decode: absorbed into
        ``mla_decode``.
    prefill: longer (or symbolic) query lengths: ``"chunked"`` computes them with
        ``mla::prefill``, the original un-absorbed form a chunk of keys at a time over the latent
        cache (working memory set by the chunk, not the context); ``"original"`` leaves them as
        the model wrote them (expanding every cached token at once).
    prefill_chunk_tokens: keys per chunk of ``mla::prefill``; 0 lets ``plan_prefill`` size the
        chunk from its memory budget.
    prefill_original_bytes: with ``"chunked"``, a site whose shapes are static and whose whole
        expansion (keys, values and the mask as a bias) fits this many bytes keeps the original
        form, which is faster there (``docs/performance.md``); 0 chunks every prefill site.
    """

    max_q_len: int = DEFAULT_MAX_Q_LEN
    prefill: str = "chunked"
    prefill_chunk_tokens: int = 0
    prefill_original_bytes: int = DEFAULT_CHUNK_BYTES

    def __post_init__(self) -> None:
        if self.prefill not in PREFILL_FORMS:
            raise ValueError(f"prefill must be one of {PREFILL_FORMS}, got {self.prefill!r}")
        for name in ("max_q_len", "prefill_chunk_tokens", "prefill_original_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")


def absorbed_mla_attention(
    query: torch.Tensor,
    latent: torch.Tensor,
    k_rot: torch.Tensor,
    kv_b_weight: torch.Tensor,
    attn_mask: torch.Tensor | None,
    softmax_scale: float,
    nope_dim: int,
    v_dim: int,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """MLA attention in the absorbed form; the drop-in replacement of a matched site.

    Args:
        query: ``[B, H, S, P+R]`` (``q_nope`` then roped ``q_pe``).
        latent: ``[B, 1, T, L]`` or ``[B, T, L]``, the normalized ``kv_c`` of every cached token.
        k_rot: ``[B, 1, T, R]`` roped shared key.
        kv_b_weight: ``kv_b_proj.weight`` ``[H*(P+V), L]``; W_UK and W_UV are views of it, so a
            weight update is always seen.
        attn_mask: ``[B|1, 1, S|1, T]`` bool (True = visible) or additive float, or None.
        sink: ``[B, H, S|1, 1]`` a logit per head that the original's softmax took beside the
            scores and then dropped (attention sinks), or None.

    Returns:
        ``[B, H, S, V]``, the attention output the original computed.
    """
    kv_c = latent[:, 0] if latent.dim() == 4 else latent  # [B, T, L]
    k_pe = k_rot[:, 0]  # [B, T, R]
    batch, cache_len = kv_c.shape[:2]
    cache_seqlens = torch.full((batch,), cache_len, dtype=torch.int32, device=query.device)
    return _absorbed(
        query, (kv_c, k_pe), cache_seqlens, None, kv_b_weight, attn_mask, softmax_scale, nope_dim,
        v_dim, sink,
    )  # fmt: skip


def absorbed_mla_attention_paged(
    query: torch.Tensor,
    pool: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    kv_b_weight: torch.Tensor,
    attn_mask: torch.Tensor | None,
    softmax_scale: float,
    nope_dim: int,
    v_dim: int,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same over a paged latent cache, read in place (no gather of the rows).

    Args:
        pool: ``[num_pages, page_size, L+R]`` rows ``[kv_c | k_pe]``.
        block_table: ``[B, max_pages]`` int32; cache_seqlens: ``[B]`` int32 tokens stored.
        attn_mask: over the token positions ``0 .. max_pages * page_size - 1``.
        The rest as in ``absorbed_mla_attention``.
    """
    kv_lora_rank = kv_b_weight.shape[-1]
    kv_cache = (pool[..., :kv_lora_rank], pool[..., kv_lora_rank:])
    return _absorbed(
        query, kv_cache, cache_seqlens, block_table, kv_b_weight, attn_mask, softmax_scale,
        nope_dim, v_dim, sink,
    )  # fmt: skip


def _absorbed(
    query: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    kv_b_weight: torch.Tensor,
    attn_mask: torch.Tensor | None,
    softmax_scale: float,
    nope_dim: int,
    v_dim: int,
    sink: torch.Tensor | None = None,
    context_parallel: tuple[str, int, int, int, bool] | None = None,
) -> torch.Tensor:
    batch, heads, q_len, _ = query.shape
    kv_lora_rank = kv_b_weight.shape[-1]
    w_kv = kv_b_weight.view(heads, nope_dim + v_dim, kv_lora_rank)
    w_uk, w_uv = w_kv[:, :nope_dim], w_kv[:, nope_dim:]  # [H, P, L], [H, V, L]
    q_lat = torch.einsum("bhsp,hpl->bshl", query[..., :nope_dim], w_uk)  # [B, S, H, L]
    q_abs = torch.cat([q_lat, query[..., nope_dim:].transpose(1, 2)], dim=-1)  # [B, S, H, L+R]
    mask = None
    if attn_mask is not None:
        mask = attn_mask[:, 0].expand(batch, q_len, attn_mask.shape[-1])  # [B, S, T_m]
        if context_parallel is not None:  # the columns of this rank's tokens
            mask = _local_columns(mask, kv_cache[0], block_table, context_parallel)
    heads_dim = None
    if context_parallel is not None and context_parallel[4]:  # the group's heads
        heads_dim = 2
        q_abs = gather_heads(q_abs, context_parallel[0], context_parallel[1], heads_dim)
    out_lat, lse = mla_decode(
        q_abs,
        kv_cache,
        cache_seqlens,
        block_table=block_table,
        head_dim_v=kv_lora_rank,
        softmax_scale=softmax_scale,
        causal=False,  # the original's visibility is all in attn_mask
        attn_mask=mask,
    )  # [B, S, H, L], lse [B, S, H]
    if context_parallel is not None:  # every rank's state, merged by LSE
        group_name, world = context_parallel[:2]
        out_lat, lse = merge_across(out_lat, lse, group_name, world, query.dtype, heads_dim)
    if sink is not None:
        # softmax([scores, sink]) gives the tokens exp(lse) / (exp(lse) + exp(sink)) of the
        # weight: sigmoid(lse - sink). A row with no visible key (lse = -inf) keeps none.
        sink_bsh = sink[..., 0].transpose(1, 2).to(lse.dtype)  # [B, S|1, H]
        kept = torch.sigmoid(lse - sink_bsh).unsqueeze(-1)  # [B, S, H, 1]
        out_lat = (out_lat.to(lse.dtype) * kept).to(out_lat.dtype)
    return torch.einsum("bshl,hvl->bhsv", out_lat, w_uv)


def chunked_mla_prefill(
    query: torch.Tensor,
    latent: torch.Tensor,
    k_rot: torch.Tensor,
    kv_b_weight: torch.Tensor,
    attn_mask: torch.Tensor | None,
    softmax_scale: float,
    nope_dim: int,
    v_dim: int,
    sink: torch.Tensor | None = None,
    chunk_tokens: int = 0,
) -> torch.Tensor:
    """The drop-in replacement of a prefill site: ``mla::prefill`` over the latent, the keys and
    values up-projected a chunk at a time (arguments as ``absorbed_mla_attention``; the mask
    ``[B|1, H|1, S|1, T]``). Returns ``[B, H, S, V]``."""
    kv_c = latent[:, 0] if latent.dim() == 4 else latent  # [B, T, L]
    k_pe = k_rot[:, 0]  # [B, T, R]
    batch, cache_len = kv_c.shape[:2]
    cache_seqlens = torch.full((batch,), cache_len, dtype=torch.int32, device=query.device)
    return _prefill(
        query,
        kv_c,
        k_pe,
        cache_seqlens,
        None,
        kv_b_weight,
        attn_mask,
        softmax_scale,
        nope_dim,
        sink,
        chunk_tokens,
    )


def chunked_mla_prefill_paged(
    query: torch.Tensor,
    pool: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    kv_b_weight: torch.Tensor,
    attn_mask: torch.Tensor | None,
    softmax_scale: float,
    nope_dim: int,
    v_dim: int,
    sink: torch.Tensor | None = None,
    chunk_tokens: int = 0,
) -> torch.Tensor:
    """The same over a paged latent cache, read in place a chunk at a time (arguments as
    ``absorbed_mla_attention_paged``)."""
    kv_lora_rank = kv_b_weight.shape[-1]
    return _prefill(
        query,
        pool[..., :kv_lora_rank],
        pool[..., kv_lora_rank:],
        cache_seqlens,
        block_table,
        kv_b_weight,
        attn_mask,
        softmax_scale,
        nope_dim,
        sink,
        chunk_tokens,
    )


def _prefill(
    query: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    kv_b_weight: torch.Tensor,
    attn_mask: torch.Tensor | None,
    softmax_scale: float,
    nope_dim: int,
    sink: torch.Tensor | None,
    chunk_tokens: int,
    context_parallel: tuple[str, int, int, int, bool] | None = None,
) -> torch.Tensor:
    if attn_mask is not None:
        while attn_mask.dim() < 4:  # broadcast leading dimensions, as the attention did
            attn_mask = attn_mask.unsqueeze(0)
    heads_dim = None
    if context_parallel is not None and context_parallel[4]:  # the group's heads
        heads_dim = 1
        query, kv_b_weight, attn_mask = group_heads(
            query, kv_b_weight, attn_mask, context_parallel[0], context_parallel[1]
        )
    if attn_mask is not None and context_parallel is not None:  # this rank's tokens' columns
        attn_mask = _local_columns(attn_mask, kv_c, block_table, context_parallel)
    out, lse = torch.ops.mla.prefill(
        query,
        kv_c,
        k_pe,
        cache_seqlens,
        block_table,
        kv_b_weight,
        attn_mask,
        softmax_scale,
        nope_dim,
        chunk_tokens,
        # the LSE is needed to weigh a sink, or to merge the ranks' states
        sink is not None or context_parallel is not None,
    )
    if context_parallel is not None:  # every rank's state, merged by LSE
        group_name, world = context_parallel[:2]
        out, lse = merge_across(out, lse, group_name, world, query.dtype, heads_dim)
    if sink is not None:  # as in _absorbed: the tokens keep sigmoid(lse - sink) of the weight
        kept = torch.sigmoid(lse - sink[..., 0].to(lse.dtype)).unsqueeze(-1)  # [B, H, S, 1]
        out = (out.to(lse.dtype) * kept).to(out.dtype)
    return out


def context_parallel_mla_attention(
    query: torch.Tensor,
    pool: torch.Tensor,
    block_table: torch.Tensor,
    local_seqlens: torch.Tensor,
    kv_b_weight: torch.Tensor,
    attn_mask: torch.Tensor | None,
    softmax_scale: float,
    nope_dim: int,
    v_dim: int,
    sink: torch.Tensor | None = None,
    *,
    group_name: str,
    world: int,
    rank: int,
    interleave: int,
    heads_sharded: bool = False,
) -> torch.Tensor:
    """``absorbed_mla_attention_paged`` over this rank's share of a cache sharded by token
    (``MLACache(context_parallel=...)``): ``mla_decode`` over the rank's pages with the mask's
    columns of its tokens, then every rank's state merged by LSE (``context_parallel.
    merge_across``, functional collectives). ``heads_sharded`` (tensor-parallel heads over the
    group): the group's absorbed queries gathered first, and each rank merges its own heads."""
    kv_lora_rank = kv_b_weight.shape[-1]
    kv_cache = (pool[..., :kv_lora_rank], pool[..., kv_lora_rank:])
    return _absorbed(
        query, kv_cache, local_seqlens, block_table, kv_b_weight, attn_mask, softmax_scale,
        nope_dim, v_dim, sink, (group_name, world, rank, interleave, heads_sharded),
    )  # fmt: skip


def context_parallel_mla_prefill(
    query: torch.Tensor,
    pool: torch.Tensor,
    block_table: torch.Tensor,
    local_seqlens: torch.Tensor,
    kv_b_weight: torch.Tensor,
    attn_mask: torch.Tensor | None,
    softmax_scale: float,
    nope_dim: int,
    v_dim: int,
    sink: torch.Tensor | None = None,
    chunk_tokens: int = 0,
    *,
    group_name: str,
    world: int,
    rank: int,
    interleave: int,
    heads_sharded: bool = False,
) -> torch.Tensor:
    """``chunked_mla_prefill_paged`` over this rank's share, merged across the group (with
    ``heads_sharded``, the group's queries and ``kv_b_proj`` rows gathered first)."""
    kv_lora_rank = kv_b_weight.shape[-1]
    return _prefill(
        query, pool[..., :kv_lora_rank], pool[..., kv_lora_rank:], local_seqlens, block_table,
        kv_b_weight, attn_mask, softmax_scale, nope_dim, sink, chunk_tokens,
        (group_name, world, rank, interleave, heads_sharded),
    )  # fmt: skip


def _local_columns(
    mask: torch.Tensor,
    rows: torch.Tensor,
    block_table: torch.Tensor,
    context_parallel: tuple[str, int, int, int, bool],
) -> torch.Tensor:
    """A mask over global positions cut to the columns of this rank's local positions."""
    _, world, rank, interleave, _ = context_parallel
    capacity = block_table.shape[1] * rows.shape[1]
    return local_mask_columns(mask, capacity, rank, world, interleave)


@dataclass
class SiteReport:
    """What ``absorb_mla`` did at one MLA site."""

    node: str
    # "rewritten" (absorbed decode); "prefill" (chunked prefill over the latent, mla::prefill);
    # "kept" (the original form, by RewriteOptions(prefill="original")); "skipped" (not safe to
    # take); or "latent-cache" (a cache update now storing latents)
    status: str
    reason: str  # why it was kept or skipped, or the shapes it was rewritten with


@dataclass
class AbsorbReport:
    """Every MLA site ``absorb_mla`` found, in graph order."""

    sites: list[SiteReport] = field(default_factory=list)
    # For an ExportedProgram input: the program to use from now on (the input when nothing was
    # rewritten, else a re-export of the rewritten module). None for a GraphModule input.
    program: torch.export.ExportedProgram | None = None

    @property
    def rewritten(self) -> int:
        return sum(s.status == "rewritten" for s in self.sites)

    @property
    def latent_cache_updates(self) -> int:
        """Cache updates of expanded K/V turned into latent appends (transformers < 5.15)."""
        return sum(s.status == "latent-cache" for s in self.sites)

    @property
    def prefill(self) -> list[SiteReport]:
        """Prefill sites now computed chunk by chunk over the latent (``mla::prefill``)."""
        return [s for s in self.sites if s.status == "prefill"]

    @property
    def kept(self) -> list[SiteReport]:
        """Prefill sites left in their original form (``RewriteOptions(prefill="original")``)."""
        return [s for s in self.sites if s.status == "kept"]

    @property
    def skipped(self) -> list[SiteReport]:
        """MLA sites the rewrite could not take safely (the reason says why)."""
        return [s for s in self.sites if s.status == "skipped"]

    def __str__(self) -> str:
        attention = [s for s in self.sites if s.status != "latent-cache"]
        lines = [f"absorb_mla: {self.rewritten} of {len(attention)} MLA sites rewritten"]
        if self.prefill:
            lines[0] += f", {len(self.prefill)} prefill sites chunked over the latent"
        if self.latent_cache_updates:
            lines[0] += f", {self.latent_cache_updates} cache updates store latents"
        lines += [f"  {s.status} {s.node}: {s.reason}" for s in self.sites]
        return "\n".join(lines)


def absorb_mla(
    gm: GraphModule | torch.export.ExportedProgram,
    *,
    max_q_len: int | None = None,
    options: RewriteOptions | None = None,
) -> AbsorbReport:
    """Rewrite every MLA attention site of ``gm``: decode into the absorbed form, prefill into
    ``mla::prefill`` (``options``, a ``RewriteOptions``; ``max_q_len`` overrides its field).

    ``gm``: a ``GraphModule`` (a dynamo graph with torch-level calls, or an exported program's
    ``.module()`` with ATen calls), rewritten in place; or an ``ExportedProgram``, left as it is:
    its module is rewritten and exported again with the program's example inputs and dynamic
    dimensions, and the new, validated program is ``report.program``.
    Returns an ``AbsorbReport``; see the module docstring for counters and logging.
    """
    options = options or RewriteOptions()
    if max_q_len is not None:
        options = dataclasses.replace(options, max_q_len=max_q_len)
    if isinstance(gm, torch.export.ExportedProgram):
        return _absorb_program(gm, options)
    if not isinstance(gm, GraphModule):
        raise TypeError(
            f"absorb_mla takes a torch.fx.GraphModule or a torch.export.ExportedProgram, got "
            f"{type(gm).__name__}"
        )
    report = AbsorbReport()
    for name, status, reason in rewrite_cache_updates(gm.graph):
        report.sites.append(SiteReport(name, status, reason))
    for candidate in attention_candidates(gm.graph):
        if candidate.graph is not gm.graph or candidate not in gm.graph.nodes:
            continue  # removed by an earlier rewrite
        try:
            site = match_site(candidate)
        except NotMLA as why:
            log.debug("fx_passes: %s '%s' is not MLA: %s", candidate.op, candidate.name, why)
            continue
        except SkipSite as why:
            _skip(report, candidate.name, str(why))
            continue
        log.info("fx_passes: found MLA site, %s", site.describe())
        if isinstance(site.q_len, int) and site.q_len <= options.max_q_len:
            read = _rewrite(gm, site)
            counters["mla"]["absorbed_sites"] += 1
            counters["mla"][f"{read}_sites"] += 1
            description = f"{site.describe()} cache={read}"
            report.sites.append(SiteReport(site.attention.name, "rewritten", description))
            log.info("fx_passes: rewrote %s", description)
            continue
        length = (
            f"symbolic query length {site.q_len}"
            if not isinstance(site.q_len, int)
            else f"S_q={site.q_len} > max_q_len={options.max_q_len}"
        )
        if options.prefill == "original":
            _keep(report, site.attention.name, f"prefill ({length})")
            continue
        expansion = original_expansion_bytes(site)
        # a sharded cache's original form would gather every rank's rows: always chunked
        sharded = context_parallel_source(site.latent, site.k_rot, site.weight) is not None
        if not sharded and expansion is not None and expansion <= options.prefill_original_bytes:
            _keep(
                report,
                site.attention.name,
                f"prefill ({length}) whose whole expansion, {expansion / 2**20:.1f} MiB, fits "
                f"prefill_original_bytes={options.prefill_original_bytes}",
            )
            continue
        read = _rewrite(gm, site, prefill_chunk_tokens=options.prefill_chunk_tokens)
        counters["mla"]["prefill_sites"] += 1
        description = f"prefill ({length}), {site.describe()} cache={read}: mla::prefill"
        report.sites.append(SiteReport(site.attention.name, "prefill", description))
        log.info("fx_passes: chunked %s", description)
    if report.rewritten or report.prefill or report.latent_cache_updates:
        gm.graph.lint()
        gm.recompile()
    return report


def _absorb_program(program: torch.export.ExportedProgram, options: RewriteOptions) -> AbsorbReport:
    """``absorb_mla`` on an exported program: rewrite its module, then export that again."""
    if program.example_inputs is None:
        raise ValueError(
            "absorb_mla on an ExportedProgram re-exports it and needs its example inputs; this "
            "program has none (export it again with torch.export.export)"
        )
    args, kwargs = program.example_inputs
    if kwargs:
        raise ValueError(
            "absorb_mla on an ExportedProgram needs a program exported with positional example "
            f"inputs only; this one has keyword inputs {sorted(kwargs)}"
        )
    module = program.module()
    report = absorb_mla(module, options=options)
    report.program = program
    if report.rewritten or report.prefill or report.latent_cache_updates:
        report.program = torch.export.export(
            module, args, dynamic_shapes=_dynamic_shapes_of(program)
        )
        report.program.validate()
    return report


def _dynamic_shapes_of(program: torch.export.ExportedProgram):
    """``dynamic_shapes`` that re-export ``program``'s inputs as they were: every symbol of the
    program becomes a named ``Dim`` with its range, a dimension ``symbol + k`` the derived
    ``Dim + k``; any other symbolic expression is left to export (``Dim.AUTO``)."""
    import sympy
    from torch.export import Dim
    from torch.utils import _pytree

    dims = {}
    for expr, bounds in program.range_constraints.items():
        if expr.is_Symbol:
            upper = int(bounds.upper) if bounds.upper.is_finite else None
            dims[expr] = Dim(str(expr), min=int(bounds.lower), max=upper)

    def dim_of(expr):
        if expr in dims:
            return dims[expr]
        if len(expr.free_symbols) == 1:
            (symbol,) = expr.free_symbols
            offset = sympy.simplify(expr - symbol)
            if symbol in dims and offset.is_Integer:
                return dims[symbol] + int(offset)
        return Dim.AUTO

    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    leaves = []
    for name in program.graph_signature.user_inputs:
        value = placeholders[name].meta.get("val")
        spec = None
        if isinstance(value, torch.Tensor):
            spec = {
                i: dim_of(size.node.expr)
                for i, size in enumerate(value.shape)
                if not isinstance(size, int)
            } or None
        leaves.append(spec)
    args_spec, _ = _pytree.tree_unflatten(leaves, program.call_spec.in_spec)
    return args_spec


def original_expansion_bytes(site: MLASite) -> int | None:
    """Bytes the original form of a prefill site allocates at once: per-head keys and values of
    every key position it reads (``B x T x H x (P + R + V)``) and its mask as a bias
    (``B x S x T``), in the query's dtype; None where a shape is symbolic."""
    query_shape, latent_shape = shape(site.query), shape(site.latent)
    value = meta_value(site.query)
    if query_shape is None or latent_shape is None or not isinstance(value, torch.Tensor):
        return None
    batch, _, q_len, _ = query_shape
    keys = latent_shape[-2]
    if not all(isinstance(d, int) for d in (batch, q_len, keys)):
        return None
    per_key = site.heads * (site.nope_dim + site.rope_dim + site.v_dim) + q_len
    return batch * keys * per_key * value.element_size()


def _keep(report: AbsorbReport, name: str, reason: str) -> None:
    counters["mla"]["kept_sites"] += 1
    report.sites.append(SiteReport(name, "kept", f"{reason}: original form kept"))
    log.info("fx_passes: kept MLA site '%s' un-absorbed: %s", name, reason)


def _skip(report: AbsorbReport, name: str, reason: str) -> None:
    counters["mla"]["skipped_sites"] += 1
    report.sites.append(SiteReport(name, "skipped", reason))
    log.info("fx_passes: skipped MLA site '%s': %s", name, reason)


def _rewrite(gm: GraphModule, site: MLASite, prefill_chunk_tokens: int | None = None) -> str:
    """Replace the site: absorbed decode, or ``mla::prefill`` when ``prefill_chunk_tokens`` is
    given. Returns how the latent is read ("paged" or "dense")."""
    graph = gm.graph
    kwargs = dict(softmax_scale=site.softmax_scale, nope_dim=site.nope_dim, v_dim=site.v_dim)
    if site.sink is not None:
        kwargs["sink"] = site.sink
    prefill = prefill_chunk_tokens is not None
    if prefill:
        kwargs["chunk_tokens"] = prefill_chunk_tokens
    shared = context_parallel_source(site.latent, site.k_rot, site.weight)
    paged = paged_source(site.latent, site.k_rot, site.weight)
    if shared is not None:
        pool, block_table, local_seqlens, group_name, world, rank, interleave, sharded = shared
        kwargs.update(group_name=group_name, world=world, rank=rank, interleave=interleave,
                      heads_sharded=sharded)  # fmt: skip
        function = context_parallel_mla_prefill if prefill else context_parallel_mla_attention
        args = (site.query, pool, block_table, local_seqlens, site.weight, site.attn_mask)
        paged = shared
    elif paged is not None:
        pool, block_table, cache_seqlens = paged
        function = chunked_mla_prefill_paged if prefill else absorbed_mla_attention_paged
        args = (site.query, pool, block_table, cache_seqlens, site.weight, site.attn_mask)
    else:
        function = chunked_mla_prefill if prefill else absorbed_mla_attention
        args = (site.query, site.latent, site.k_rot, site.weight, site.attn_mask)
    with graph.inserting_before(site.attention):
        new = graph.call_function(function, args=args, kwargs=kwargs)
    _record_fake_value(new, function, args, kwargs)
    site.attention.replace_all_uses_with(new)
    order = {node: i for i, node in enumerate(graph.nodes)}
    dead = set(site.internal)
    if paged is not None:  # the gather of the rows and its views, when nothing else reads them
        dead |= _view_chain(site.latent) | _view_chain(site.k_rot)
    for node in sorted(dead, key=order.__getitem__, reverse=True):
        if not node.users:
            graph.erase_node(node)
    return "context_parallel" if shared is not None else "paged" if paged else "dense"


def context_parallel_source(latent: Node, k_rot: Node, weight: Node) -> tuple | None:
    """``(pool, block_table, local_seqlens, group_name, world, rank, interleave, heads_sharded)``
    when the
    site's latent and rope key are the column ranges of one ``mla::cp_rows`` gather (a
    context-parallel ``MLACache``): this rank's pages are read in place; else None."""
    source = _rows_source(latent, k_rot, weight)
    if source is None or kind(source) != "cp_rows":
        return None
    names = ("pool", "block_table", "local_seqlens", "group_name", "world", "rank", "interleave")
    return (*(named_arg(source, name) for name in names), named_arg(source, "heads_sharded", False))


def _rows_source(latent: Node, k_rot: Node, weight: Node) -> Node | None:
    """The one gather (``paged_rows`` or ``cp_rows``) whose column ranges ``[0, L)`` and
    ``[L, L+R)`` are the site's latent and rope key, or None."""
    ranges = []
    for node in (latent, k_rot):
        while kind(node) == "unsqueeze":
            node = named_arg(node, "input")
        taken = last_dim_range(node)
        if taken is None:
            return None
        ranges.append(taken)
    (source, start, end), (rope_source, rope_start, rope_end) = ranges
    weight_shape, source_shape = shape(weight), shape(source)
    if source is not rope_source or kind(source) not in ("paged_rows", "cp_rows"):
        return None
    if weight_shape is None or source_shape is None:
        return None
    kv_lora_rank = weight_shape[-1]
    if (start, end, rope_start, rope_end) != (0, kv_lora_rank, kv_lora_rank, source_shape[-1]):
        return None
    return source


def paged_source(latent: Node, k_rot: Node, weight: Node) -> tuple[Node, Node, Node] | None:
    """``(pool, block_table, cache_seqlens)`` when the site's latent and rope key are the two
    column ranges ``[0, L)`` and ``[L, L+R)`` of one ``mla::paged_rows`` gather (``MLACache``
    in static mode), so the pages can be read in place; else None."""
    source = _rows_source(latent, k_rot, weight)
    if source is None or kind(source) != "paged_rows":
        return None
    return tuple(named_arg(source, name) for name in ("pool", "block_table", "cache_seqlens"))


def _view_chain(node: Node) -> set[Node]:
    """``node`` and the unsqueeze / column-range / gather nodes it was taken from."""
    chain = set()
    while node is not None:
        chain.add(node)
        if kind(node) == "unsqueeze":
            node = named_arg(node, "input")
        elif kind(node) in ("paged_rows", "cp_rows"):
            node = None
        else:
            taken = last_dim_range(node)
            node = None if taken is None else taken[0]
    return chain


def _record_fake_value(new: Node, function, args: tuple, kwargs: dict) -> None:
    """Give the new node the fake value later passes read (``val`` or ``example_value``)."""
    values = [meta_value(a) if isinstance(a, Node) else a for a in args]
    kwargs = {k: meta_value(v) if isinstance(v, Node) else v for k, v in kwargs.items()}
    if any(v is None for v in values[:-1]) or any(v is None for v in kwargs.values()):
        return
    fake_mode = torch._guards.detect_fake_mode([v for v in values if v is not None])
    if fake_mode is None:
        return
    key = "val" if "val" in args[0].meta else "example_value"
    try:
        with fake_mode:
            new.meta[key] = function(*values, **kwargs)
    except Exception as error:  # metadata only: the rewrite stands without it
        log.debug("fx_passes: no fake value for %s: %s", new.name, error)
