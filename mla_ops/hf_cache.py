"""``MLACache``: a Hugging Face ``Cache`` that stores MLA latents in pages.

One ``[kv_c | k_pe]`` row per token per layer in a ``PagedLatentCache`` (the layout
``mla_decode`` reads):

    cache = MLACache(model.config, max_length=4096, static=True)
    model.generate(input_ids, **cache_kwargs(model, cache), max_new_tokens=...)

transformers 5.24 renamed the cache argument of ``forward`` and ``generate`` from
``past_key_values`` to ``cache`` (the old name warns, and goes in 5.40): ``cache_kwargs(model,
cache)`` passes the cache by the name a model takes, ``output_cache(output)`` reads it back.

transformers >= 5.15 (>= 5.18 for the DeepSeek Sparse Attention families, see
``MIN_TRANSFORMERS_SPARSE``): the MLA attention calls ``update(kv_c [B, 1, S, L], k_pe [B, 1,
S, R])``; the cache stores the rows and returns the latents (growing mode: ``T`` = the length;
static mode: the capacity, zero past the length, through ``mla::paged_rows``), so an unrewritten
model generates exactly as with ``DynamicCache``, and ``fx_passes`` turns the read into
``mla_decode`` over the pages.

transformers < 5.15 (and DeepSeek's original remote code): the attention hands the cache expanded
per-head K/V (told apart from latents by shape). In static mode, under
``torch.compile(backend="mla")``, the update is the marker op ``mla::expanded_kv_update``, which
``fx_passes`` replaces by a latent append and a re-expansion, so the model stores latents only
(static mode run eagerly is refused with that advice). In growing mode (an unrewritten model)
the layer keeps the expanded K/V as they are, like ``DynamicCache``, and says so in a warning.

Static mode keeps every tensor at a fixed address and the lengths on the device: a decode step
compiles once (and can run as a CUDA graph).
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, NoReturn

import torch
import torch.distributed as dist

try:
    import transformers
    from transformers.cache_utils import Cache, CacheLayerMixin
except ImportError as error:  # the [hf] extra
    raise ImportError(
        "mla_compile.mla_ops.hf_cache (MLACache) needs Hugging Face transformers >= 5.14: "
        "pip install 'mla-compile[hf]'"
    ) from error

from .context_parallel import ContextParallel, ContextParallelCache
from .paged_cache import PagedLatentCache, capacity_for

# The first release whose MLA attention caches latents (kv_c, k_pe) instead of per-head K/V.
MIN_TRANSFORMERS = (5, 15)
# The same for the DeepSeek Sparse Attention families (deepseek_v32, glm_moe_dsa, axk2, hy_v4,
# glm5_next): through 5.17 their attention caches expanded per-head K/V and runs the indexer
# around them; 5.18 caches their latents too.
MIN_TRANSFORMERS_SPARSE = (5, 18)


def transformers_version() -> tuple[int, int]:
    """``(major, minor)`` of the installed transformers."""
    return tuple(int(part) for part in transformers.__version__.split(".")[:2])


LATENT_ATTENTION = transformers_version() >= MIN_TRANSFORMERS
SPARSE_LATENT_ATTENTION = transformers_version() >= MIN_TRANSFORMERS_SPARSE


def cache_kwargs(model: torch.nn.Module, cache: Cache | None) -> dict[str, Cache | None]:
    """``cache`` under the keyword ``model``'s ``forward`` (and so ``generate``) takes it by:
    ``{"cache": cache}`` where its signature has ``cache`` (transformers >= 5.24, which deprecates
    ``past_key_values`` and drops it in 5.40), else ``{"past_key_values": cache}`` (older
    releases, and remote code written for them).

    ``model.generate(ids, **cache_kwargs(model, cache))`` runs without the deprecation warning on
    every release. A compiled model (``torch.compile``) is read through its ``_orig_mod``.
    A context-parallel ``MLACache`` is checked against the model's tensor parallelism (its group
    inside the model's tensor-parallel group, the cache made from this model's config)."""
    module = getattr(model, "_orig_mod", model)
    forward = getattr(module, "forward", None)
    if forward is None:
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(cache, MLACache) and cache.store.context_parallel is not None:
        _check_context_parallel_heads(module, cache)
        _check_group_agrees(cache)
    name = "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"
    return {name: cache}


def tensor_parallel_size(config) -> int:
    """How many ranks the model's heads are split over: transformers' ``distributed_config``
    (set on the config of a model loaded with ``DistributedConfig(tp_plan=...)``), else 1."""
    distributed = getattr(config, "distributed_config", None)
    if isinstance(distributed, dict):
        size = distributed.get("tp_size")
    else:
        size = getattr(distributed, "tp_size", None)
    return int(size or 1)


def _tensor_parallel_ranks(model: torch.nn.Module) -> list[int] | None:
    """The global ranks of the model's tensor-parallel group (transformers' device mesh), or
    None where the model does not say."""
    manager = getattr(model, "_mesh_manager", None)
    mesh = None
    if manager is not None:
        try:
            mesh = manager.get_mesh("tp")
        except (KeyError, ValueError, RuntimeError):
            mesh = None
    mesh = mesh or getattr(model, "_device_mesh", None)
    if mesh is None or mesh.ndim != 1:
        return None
    return dist.get_process_group_ranks(mesh.get_group())


def _check_group_agrees(cache: MLACache) -> None:
    """Every rank of a context-parallel cache's group must hold a cache made alike (the same
    shapes, lengths and sharding): one small all-gather of the settings, so that a mismatch is
    an error naming the ranks rather than wrong tokens or a collective that never returns."""
    store = cache.store
    group = store.context_parallel.group or dist.group.WORLD
    storage = store.cache
    mine = dict(
        max_length=store.max_length, page_size=store.page_size,
        interleave=store.context_parallel.interleave, kv_len=store.kv_len,
        rope_len=store.rope_len, layers=store.num_layers, heads_sharded=store.heads_sharded,
        batch_size=None if storage is None else storage.batch_size,
        dtype=None if storage is None else str(storage.local.pools[0].dtype),
    )  # fmt: skip
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    differ = sorted({key for other in every for key in mine if other[key] != mine[key]})
    if differ:
        ranks = dist.get_process_group_ranks(group)
        seen = {key: [other[key] for other in every] for key in differ}
        raise ValueError(
            f"MLACache(context_parallel=...): the caches of the group's ranks {ranks} differ in "
            f"{', '.join(differ)} ({seen}); every rank must make the same cache"
        )


def _check_context_parallel_heads(model: torch.nn.Module, cache: MLACache) -> None:
    """Refuse a context-parallel cache that does not match the model's head sharding: ranks that
    hold different heads would otherwise merge the states of different heads."""
    size = tensor_parallel_size(model.config)
    if cache.store.heads_sharded != (size > 1):
        raise ValueError(
            f"MLACache(context_parallel=...) was made for a model with "
            f"{'tensor-parallel' if cache.store.heads_sharded else 'whole'} heads, but this model "
            f"splits its heads over {size} rank(s) (config.distributed_config.tp_size): make the "
            "cache from this model's config"
        )
    if size == 1:
        return
    tensor_ranks = _tensor_parallel_ranks(model)
    group = cache.store.context_parallel.group or dist.group.WORLD
    ranks = dist.get_process_group_ranks(group)
    if tensor_ranks is not None and not set(ranks) <= set(tensor_ranks):
        raise ValueError(
            f"MLACache(context_parallel=...): the group's ranks {ranks} must lie inside the "
            f"model's tensor-parallel group {tensor_ranks}, whose ranks hold the heads the "
            "group's queries are gathered from"
        )


def output_cache(output: Any) -> Cache | None:
    """The cache a Hugging Face model or ``generate`` output holds: its ``cache`` field
    (transformers >= 5.24, where reading ``past_key_values`` warns) or ``past_key_values``."""
    fields = getattr(type(output), "__dataclass_fields__", {})
    return output.cache if "cache" in fields else output.past_key_values


@torch.compiler.disable(reason="raises a refusal in eager mode, where its message stays first")
def _refuse(error: Exception) -> NoReturn:
    """Raise ``error`` as it is, also from a compiled forward: raised while dynamo traces, an
    exception comes back wrapped in dynamo's own, the advice buried in its debug context."""
    raise error


_GROWING_UNDER_COMPILE = (
    "MLACache(static=False) grows its pages and lengths on the host, which torch.compile would "
    "guard on at every step: use MLACache(..., static=True) with torch.compile"
)


@torch.compiler.disable(reason=_GROWING_UNDER_COMPILE)
def _refuse_growing_under_compile() -> NoReturn:
    """``_refuse`` of this one refusal, its advice also the reason a ``fullgraph=True`` compile
    shows (there dynamo reports the call to a disabled function, with its reason, first)."""
    raise RuntimeError(_GROWING_UNDER_COMPILE)


class _SharedStore:
    """The one ``PagedLatentCache`` behind all layers, created at the first update."""

    def __init__(
        self,
        num_layers: int,
        kv_len: int,
        rope_len: int,
        max_length: int,
        page_size: int,
        static: bool,
        num_pages: int | None,
        index_len: int = 0,
        index_layers: list[int] | None = None,
        context_parallel: ContextParallel | None = None,
    ) -> None:
        self.context_parallel = context_parallel
        # The context-parallel group's ranks hold different heads (tensor parallelism)
        self.heads_sharded = False
        self.num_layers, self.kv_len, self.rope_len = num_layers, kv_len, rope_len
        self.max_length, self.page_size = max_length, page_size
        self.static, self.num_pages = static, num_pages
        self.index_len, self.index_layers = index_len, index_layers
        self.cache: PagedLatentCache | ContextParallelCache | None = None
        self.single_head_widths: tuple[int, int | None] | None = None

    @property
    def capacity(self) -> int:
        """Token positions per sequence, before the storage exists (``capacity_for``)."""
        return capacity_for(self.max_length, self.page_size)

    def get(
        self, batch_size: int, dtype: torch.dtype, device: torch.device
    ) -> PagedLatentCache | ContextParallelCache:
        if self.cache is None and self.context_parallel is not None:
            rank, world, name = self.context_parallel.ranks()
            self.cache = ContextParallelCache(
                rank=rank, world=world, interleave=self.context_parallel.interleave,
                group_name=name, num_layers=self.num_layers, batch_size=batch_size,
                kv_len=self.kv_len, rope_len=self.rope_len, max_length=self.max_length,
                page_size=self.page_size, static=True, dtype=dtype, device=device,
                heads_sharded=self.heads_sharded,
            )  # fmt: skip
            self.mark_static()
        if self.cache is None:
            self.cache = PagedLatentCache(
                num_layers=self.num_layers,
                batch_size=batch_size,
                kv_len=self.kv_len,
                rope_len=self.rope_len,
                max_length=self.max_length,
                page_size=self.page_size,
                num_pages=self.num_pages,
                static=self.static,
                dtype=dtype,
                device=device,
                index_len=self.index_len,
                index_layers=self.index_layers,
            )
            self.mark_static()
        return self.cache

    def mark_static(self) -> None:
        """Fixed addresses (static mode): compiled graphs and CUDA graphs read them in place."""
        if self.static and self.cache is not None and not torch.compiler.is_compiling():
            for tensor in self.cache.fixed_tensors():
                torch._dynamo.mark_static_address(tensor)


class MLACacheLayer(CacheLayerMixin):
    """One layer's view of the shared paged store (or, for an unrewritten transformers < 5.15
    model, of the expanded K/V it was handed)."""

    is_sliding = False
    is_croppable = True

    def __init__(self, store: _SharedStore, layer_idx: int) -> None:
        super().__init__()
        self.store, self.layer_idx = store, layer_idx
        # Static mode keeps every length on the device: a decode step compiles once.
        self.is_compileable = store.static
        self.mode: str | None = None  # "latent" or "expanded", fixed by the first update
        self.expanded: tuple[torch.Tensor, torch.Tensor] | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens; return the keys and values attention reads (see the module
        docstring for each transformers version)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._check_widths(key_states, value_states)
        if not self._is_latent(key_states, value_states):
            # Expanded per-head K/V: transformers < 5.15, or DeepSeek's original remote code.
            if self.store.static:
                return self._update_traced_expanded(key_states, value_states)
            return self._update_expanded(key_states, value_states)
        self._check_compile_mode()
        self._set_mode("latent")
        cache = self.store.get(key_states.shape[0], key_states.dtype, key_states.device)
        cache.append(self.layer_idx, key_states[:, 0], value_states[:, 0])
        # [B, T, L], [B, T, R]; static: T = capacity, zero past the length (the mask hides it)
        kv_c, k_pe = cache.rows(self.layer_idx)
        return kv_c.unsqueeze(1), k_pe.unsqueeze(1)

    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        """DeepSeek Sparse Attention's indexer keys ``[B, S, D]`` of the tokens this layer just
        stored; returns every stored key, ``[B, T, D]`` (``T`` as the latents' ``update``), which
        the indexer scores under the attention mask (transformers' ``DynamicIndexedLayer``)."""
        if self.mode != "latent":
            raise RuntimeError(
                f"MLACache layer {self.layer_idx}: update_indexer before the layer's latents were "
                "stored; the indexer's keys go at the positions of the tokens stored last"
            )
        cache = self.store.cache
        cache.append_index(self.layer_idx, indexer_key_states)
        return cache.index_rows(self.layer_idx)

    def _is_latent(self, key_states: torch.Tensor, value_states: torch.Tensor) -> bool:
        """``[B, 1, S, L]`` and ``[B, 1, S, R]``: what latent-caching attention hands over."""
        return (
            key_states.dim() == 4
            and key_states.shape[1] == 1
            and value_states.shape[1] == 1
            and key_states.shape[-1] == self.store.kv_len
            and value_states.shape[-1] == self.store.rope_len
        )

    def _check_widths(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Rows in the latents' ``[B, 1, S, .]`` layout must have the config's latent widths: a
        wrong width is an error, never a silent switch to storing expanded K/V."""
        store = self.store
        if not (
            key_states.dim() == 4 == value_states.dim()
            and key_states.shape[1] == 1 == value_states.shape[1]
        ):
            return
        widths = (key_states.shape[-1], value_states.shape[-1])
        if widths == (store.kv_len, store.rope_len) or widths == store.single_head_widths:
            return
        _refuse(
            ValueError(
                f"MLACache layer {self.layer_idx}: latent rows of widths (kv_c {widths[0]}, k_pe "
                f"{widths[1]}); the config gives kv_lora_rank={store.kv_len} and "
                f"qk_rope_head_dim={store.rope_len}"
            )
        )

    def _check_compile_mode(self) -> None:
        if not self.store.static and torch.compiler.is_compiling():
            _refuse_growing_under_compile()

    def _update_traced_expanded(
        self, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers < 5.15, static mode: the marker op fx_passes rewrites."""
        if not torch.compiler.is_compiling():
            raise RuntimeError(
                "MLACache(static=True) stores latents, which this attention (transformers < 5.15 "
                "or remote code) does not hand over: run the model through "
                "torch.compile(model.forward, backend='mla') (its rewrite stores latents), or use "
                "MLACache(static=False) (stores the expanded K/V) or DynamicCache"
            )
        self._set_mode("latent")
        cache = self.store.get(key_states.shape[0], key_states.dtype, key_states.device)
        return torch.ops.mla.expanded_kv_update(
            key_states,
            value_states,
            cache.pools[self.layer_idx],
            cache.block_table,
            cache.seqlens[self.layer_idx],
        )

    def _update_expanded(
        self, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers < 5.15, eager (an unrewritten model): keep the expanded K/V."""
        self._check_compile_mode()
        if self.mode is None and self.layer_idx == 0:
            warnings.warn(
                "MLACache: this attention (transformers < 5.15 or remote code) hands the cache "
                "expanded per-head K/V and the model is not rewritten, so they are stored as they "
                "are (no memory saving); torch.compile(model.forward, backend='mla') with "
                "MLACache(static=True) stores latents",
                stacklevel=3,
            )
        self._set_mode("expanded")
        if self.expanded is None:
            self.expanded = (key_states, value_states)
        else:
            keys, values = self.expanded
            self.expanded = (
                torch.cat([keys, key_states], dim=-2),
                torch.cat([values, value_states], dim=-2),
            )
        return self.expanded

    def _set_mode(self, mode: str) -> None:
        # Under compile the mode is stored, not read (a read would guard the graph on the
        # layer's history and recompile after the first call or a reset); expanded rows, the
        # one conflict a compiled step can meet, show as ``self.expanded``.
        conflict = self.expanded is not None if torch.compiler.is_compiling() else self.mode
        if conflict and self.mode != mode:
            _refuse(
                RuntimeError(
                    f"MLACache layer {self.layer_idx} holds {self.mode} rows and was handed "
                    f"{mode} ones: with transformers < 5.15 run every step of a generation "
                    "through torch.compile(backend='mla') (latents) or none (expanded K/V); "
                    "reset() between"
                )
            )
        self.mode = mode

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # generate() treats the tokens a cache holds as the start of its prompt and runs only
        # the rest: a prompt no longer than them leaves nothing to run (the model then fails on
        # an empty tensor).
        if query_length == 0 and not torch.compiler.is_compiling():
            raise ValueError(
                f"MLACache already holds {int(self.get_seq_length())} tokens per sequence, as "
                "many as or more than the new input: call cache.reset() before generating from "
                "a new prompt (generate() reads a cache's tokens as the prompt's first ones, so "
                "a follow-up turn passes the whole conversation)"
            )
        # Static mode returns (and masks) the whole capacity; Hugging Face may build this mask
        # outside the compiled forward, so it cannot depend on whether tracing is on.
        if self.store.static:
            return self.store.capacity, 0
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int | torch.Tensor:
        """Tokens cached per sequence; static mode: a 0-dim device tensor (as Hugging Face's
        ``StaticLayer``), so reading it needs no host sync and adds no guard."""
        if self.expanded is not None:  # expanded mode (read instead of the mode: see _set_mode)
            return self.expanded[0].shape[-2]
        cache = self.store.cache
        if cache is None:
            return 0
        if self.store.static:
            return cache.seqlens[self.layer_idx, 0]
        return cache.get_seq_length(self.layer_idx)

    def get_max_length(self) -> int:
        return self.store.max_length

    def reset(self) -> None:
        """Empty the layer. The storage stays where it is, and a layer that held latents still
        expects latents: a compiled step reads both, so neither change makes it recompile."""
        if self.store.cache is not None:
            self.store.cache.crop(0, layer=self.layer_idx)
        if self.mode != "latent":
            self.mode, self.expanded = None, None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.expanded is not None:
            index = beam_idx.to(self.expanded[0].device)
            self.expanded = tuple(t.index_select(0, index) for t in self.expanded)
        if self.store.cache is not None:
            self.store.cache.reorder(beam_idx, layer=self.layer_idx)

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (transformers' convention: <= 0)."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop takes a negative number of tokens to remove, got {tokens_to_remove}"
            )
        if tokens_to_remove < 0 and self.expanded is not None:
            self.expanded = tuple(t[..., :tokens_to_remove, :] for t in self.expanded)
        if tokens_to_remove < 0 and self.store.cache is not None:
            self.store.cache.crop(tokens_to_remove, layer=self.layer_idx)

    # Batch changes of the paged store happen once, in MLACache (all layers share it); a layer
    # only regroups the expanded K/V it may hold.
    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.expanded is not None:
            self.expanded = tuple(t.repeat_interleave(repeats, dim=0) for t in self.expanded)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.expanded is not None:
            self.expanded = tuple(t[indices] for t in self.expanded)


def _selected_sequences(indices, batch: int) -> torch.Tensor:
    """The sequence indices ``batch_select_indices`` keeps, as a 1-D long tensor: a bool mask
    selects where it is True (as indexing does), an integer index is taken as it is."""
    indices = torch.as_tensor(indices)
    if indices.dtype == torch.bool:
        if indices.shape != (batch,):
            raise ValueError(
                f"a bool batch_select_indices mask must be [batch={batch}], got "
                f"{tuple(indices.shape)}"
            )
        return indices.cpu().nonzero().reshape(-1)
    if indices.is_floating_point() or indices.is_complex():
        raise TypeError(f"batch_select_indices takes integer or bool indices, got {indices.dtype}")
    return indices.long().reshape(-1)


def _latent_width(text, layer: int) -> tuple[int | None, int]:
    """``(kv_lora_rank, qk_rope_head_dim)`` of one layer; heterogeneous configs (transformers'
    ``per_layer_config``) may give each layer its own."""
    per_layer = getattr(text, "per_layer_config", None)
    layer_config = per_layer[layer] if per_layer is not None else text
    kv_len = getattr(layer_config, "kv_lora_rank", None)
    return kv_len, getattr(layer_config, "qk_rope_head_dim", 0)


def _sparse_refusal(text) -> str | None:
    """Why MLACache cannot keep a DeepSeek Sparse Attention model's indexer state (None if it
    can): it keeps one key per token per indexed layer, written after the layer's latents, as
    the latent-caching attention of transformers >= 5.18 does for these families."""
    if not SPARSE_LATENT_ATTENTION:
        return (
            f"transformers {transformers.__version__} runs its indexer around expanded K/V "
            "(latent caching of sparse-attention models, and MLACache's indexer keys, need >= "
            f"{MIN_TRANSFORMERS_SPARSE[0]}.{MIN_TRANSFORMERS_SPARSE[1]})"
        )
    if getattr(text, "index_kpool", 1) > 1:
        return f"its indexer caches keys pooled over {text.index_kpool} tokens (index_kpool)"
    sources = getattr(text, "kv_source_layers", None)
    if sources is not None and any(source != layer for layer, source in enumerate(sources)):
        return "some layers read another layer's latents (kv_source_layers)"
    return None


def _check_context_parallel(
    context_parallel: ContextParallel, static: bool, index_len: int, num_pages: int | None
) -> None:
    if not isinstance(context_parallel, ContextParallel):
        raise TypeError(
            f"context_parallel must be a ContextParallel, got {type(context_parallel).__name__}"
        )
    if not static:
        raise ValueError("MLACache(context_parallel=...) needs static=True (device lengths)")
    if index_len:
        raise NotImplementedError(
            "MLACache(context_parallel=...) does not shard a sparse-attention indexer's keys"
        )
    if num_pages is not None:
        raise ValueError("MLACache(context_parallel=...) sizes each rank's pages itself")
    if not LATENT_ATTENTION:
        raise NotImplementedError(
            "MLACache(context_parallel=...) needs transformers >= 5.15, whose attention hands "
            "the cache latents"
        )
    if not dist.is_initialized():
        raise RuntimeError(
            "MLACache(context_parallel=...) needs torch.distributed initialised "
            "(dist.init_process_group, or torchrun)"
        )


class MLACache(Cache):
    """Paged latent cache for MLA models: ``generate(..., cache=MLACache(config))``
    (``past_key_values=`` before transformers 5.24; ``cache_kwargs`` picks the name).

    Args:
        config: the model's config (``num_hidden_layers`` is read from it).
        max_length: most tokens per sequence (prompt plus generated).
        page_size: tokens per page.
        static: allocate every page up front (fixed tensor addresses).
        num_pages: pages per layer pool (default: enough for the batch at ``max_length``).
        batch_size, dtype, device: allocate the storage now (all three, or none: then at the
            first update). With ``torch.compile`` this keeps the first prefill's graph for every
            later one.
        context_parallel: a ``ContextParallel``: shard the cache by token across its process
            group (static mode; each rank holds ``1 / world`` of every sequence's tokens). The
            rewritten model (``backend="mla"``) attends over each rank's pages and merges the
            ranks' states; an unrewritten one gathers the whole cache on every step (correct,
            without the saving). A model loaded with tensor parallelism (its config's
            ``distributed_config.tp_size > 1``) holds different heads on each rank: the group
            must then lie inside the tensor-parallel group (``cache_kwargs`` checks it), and the
            rewrite gathers the group's queries and gives each rank its own heads back.

    Reuse: ``reset()`` before a new prompt (no recompilation). Without it ``generate()`` reads
    the cached tokens as the prompt's first ones, as with any Hugging Face cache: a follow-up
    turn passes the whole conversation; a prompt no longer than the cache is refused.
    """

    def __init__(
        self,
        config,
        max_length: int,
        page_size: int = 64,
        static: bool = False,
        num_pages: int | None = None,
        *,
        batch_size: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        context_parallel: ContextParallel | None = None,
    ) -> None:
        text = config.get_text_config()
        # The refusals come first: they read no per-layer attribute, which a heterogeneous
        # config (Dots 3 Note's per-layer MLA shapes) refuses to give globally.
        sparse = getattr(text, "index_topk", None) is not None
        # DeepSeek Sparse Attention's layers: "indexed_attention" ("deepseek_sparse_attention"
        # before transformers 5.18)
        indexed = {"indexed_attention", "deepseek_sparse_attention"}
        kept = {"full_attention", *indexed} if sparse else {"full_attention"}
        other_layers = sorted(set(getattr(text, "layer_types", None) or ()) - kept)
        if other_layers:
            # Hybrid models (Kimi Linear, Bailing hybrid, GLM-5 Next) keep recurrent states for
            # their linear attention layers in transformers' own cache layers, which this cache
            # does not make; sliding-window layers (Dots 3 Note) keep a window of their own.
            raise NotImplementedError(
                f"MLACache holds MLA latents only; {type(config).__name__} also has "
                f"{', '.join(other_layers)} layers (config.layer_types), whose states it does "
                "not keep; use the model's default cache, which torch.compile(backend='mla') "
                "rewrites too"
            )
        index_len, index_layers = 0, None
        if sparse:
            # DeepSeek Sparse Attention caches its indexer's keys beside the latents
            # (transformers' DynamicIndexedLayer): kept in pools of their own (update_indexer).
            why = _sparse_refusal(text)
            if why:
                raise NotImplementedError(
                    f"MLACache does not keep {type(config).__name__}'s sparse-attention indexer "
                    f"state (index_topk={text.index_topk}): {why}; use the model's default "
                    "cache, which torch.compile(backend='mla') rewrites too"
                )
            index_len = text.index_head_dim
            indexer_types = getattr(text, "indexer_types", None)  # "shared": no indexer of its own
            index_layers = [
                layer
                for layer in range(text.num_hidden_layers)
                if indexer_types is None or indexer_types[layer] != "shared"
            ]
        widths = {_latent_width(text, layer) for layer in range(text.num_hidden_layers)}
        if len(widths) > 1:
            raise NotImplementedError(
                f"MLACache keeps one latent width for every layer; {type(config).__name__}'s "
                f"layers have (kv_lora_rank, qk_rope_head_dim) of {sorted(widths)}; use the "
                "model's default cache, which torch.compile(backend='mla') rewrites too"
            )
        ((kv_len, rope_len),) = widths
        if kv_len is None:
            raise ValueError(
                f"MLACache is for MLA models; {type(config).__name__} has no kv_lora_rank"
            )
        if context_parallel is not None:
            _check_context_parallel(context_parallel, static, index_len, num_pages)
        self.store = _SharedStore(
            text.num_hidden_layers, kv_len, rope_len, max_length, page_size, static, num_pages,
            index_len, index_layers, context_parallel,
        )  # fmt: skip
        self.store.heads_sharded = context_parallel is not None and tensor_parallel_size(config) > 1
        # A model of one attention head hands expanded K/V in the latents' [B, 1, S, .] layout:
        # their widths tell them apart.
        if getattr(text, "num_attention_heads", None) == 1:
            self.store.single_head_widths = (
                getattr(text, "qk_nope_head_dim", 0) + getattr(text, "qk_rope_head_dim", 0),
                getattr(text, "v_head_dim", None),
            )
        super().__init__(
            layers=[MLACacheLayer(self.store, i) for i in range(text.num_hidden_layers)]
        )
        given = [batch_size is not None, dtype is not None, device is not None]
        if any(given) and not all(given):
            raise ValueError(
                "MLACache: batch_size, dtype and device allocate the storage up front and come "
                f"together; got batch_size={batch_size}, dtype={dtype}, device={device}"
            )
        if all(given):
            # Allocated now rather than inside the first compiled prefill: that prefill and
            # every later one then see the same storage and share one graph.
            storage = self.store.get(batch_size, dtype, torch.device(device))
            for layer in self.layers:
                layer.dtype, layer.device = dtype, storage.device
                layer.is_initialized = True

    @property
    def paged(self) -> PagedLatentCache | None:
        """The storage (``None`` before the first update)."""
        return self.store.cache

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the sequences ``indices`` (in that order), or, for a bool ``[batch]`` mask, the
        sequences where it is True: what ``DynamicCache`` keeps for either form."""
        if self.store.cache is not None:
            self.store.cache.regroup(_selected_sequences(indices, self.store.cache.batch_size))
            self.store.mark_static()
        for layer in self.layers:
            layer.batch_select_indices(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every sequence ``repeats`` times in place (``[a, b] -> [a, a, b, b]``)."""
        if self.store.cache is not None:
            batch = self.store.cache.batch_size
            self.store.cache.regroup(torch.arange(batch).repeat_interleave(repeats))
            self.store.mark_static()
        for layer in self.layers:
            layer.batch_repeat_interleave(repeats)

    def bytes_per_token(self) -> int:
        """Bytes one cached token occupies summed over the layers, as stored: one latent row
        ``(L+R) x element size`` per layer, or the expanded K/V ``H x (P+R+V) x element size``
        per layer an unrewritten transformers < 5.15 model handed over; plus a sparse-attention
        model's indexer keys (``index_head_dim x element size`` per indexed layer). 0 before
        the first update."""
        total = 0
        for layer in self.layers:
            if layer.mode == "expanded":
                total += sum(t[0, :, 0].numel() * t.element_size() for t in layer.expanded)
            elif layer.mode == "latent":
                total += self.store.cache.bytes_per_token_per_layer()
        if self.store.cache is not None:
            total += self.store.cache.index_bytes_per_token()
        return total
