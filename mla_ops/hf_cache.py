"""``MLACache``: a Hugging Face ``Cache`` that stores MLA latents in pages (transformers >= 5.15).

In transformers >= 5.15 the MLA attention of DeepSeek-V2/V3 and the related families calls
``past_key_values.update(kv_c, k_pe, layer_idx)`` with the normalised latent ``kv_c [B, 1, S, L]``
and the roped ``k_pe [B, 1, S, R]``. ``MLACache`` keeps them as one ``[kv_c | k_pe]`` row per
token per layer in a ``PagedLatentCache`` (the layout ``mla_decode`` reads) and returns the full
latents, so an unrewritten model generates exactly as with ``DynamicCache``.

    cache = MLACache(model.config, max_length=4096)
    model.generate(input_ids, past_key_values=cache, max_new_tokens=...)

Status (issue 5): greedy, sampling, beam search and prompt-lookup decoding on transformers >= 5.15,
eager. Not done yet: ``torch.compile`` (the length lives on the host, so dynamo guards on it and
recompiles every decode step; it has to move to a device tensor as in ``StaticCache``), the
rewritten model reading it through ``mla_decode``, transformers <= 5.14, batch-size changes.
"""

from __future__ import annotations

import torch
import transformers

from .paged_cache import PagedLatentCache

# The first release whose MLA attention caches latents (kv_c, k_pe) instead of per-head K/V.
MIN_TRANSFORMERS = (5, 15)


def transformers_version() -> tuple[int, int]:
    """``(major, minor)`` of the installed transformers."""
    return tuple(int(part) for part in transformers.__version__.split(".")[:2])


if transformers_version() < MIN_TRANSFORMERS:
    raise ImportError(
        f"mla_ops.hf_cache needs transformers >= 5.15 (found {transformers.__version__}): older "
        "releases cache expanded per-head keys and values, not MLA latents"
    )
from transformers.cache_utils import Cache, CacheLayerMixin  # noqa: E402 (after the version check)


class _SharedStore:
    """The one ``PagedLatentCache`` behind all layers, created at the first update."""

    def __init__(
        self, num_layers: int, max_length: int, page_size: int, static: bool, num_pages: int | None
    ) -> None:
        self.num_layers, self.max_length = num_layers, max_length
        self.page_size, self.static, self.num_pages = page_size, static, num_pages
        self.cache: PagedLatentCache | None = None

    @property
    def capacity(self) -> int:
        """Token positions per sequence: ``max_length`` rounded up to whole pages."""
        return -(-self.max_length // self.page_size) * self.page_size

    def get(self, kv_c: torch.Tensor, k_pe: torch.Tensor) -> PagedLatentCache:
        if self.cache is None:
            self.cache = PagedLatentCache(
                num_layers=self.num_layers,
                batch_size=kv_c.shape[0],
                kv_len=kv_c.shape[-1],
                rope_len=k_pe.shape[-1],
                max_length=self.max_length,
                page_size=self.page_size,
                num_pages=self.num_pages,
                static=self.static,
                dtype=kv_c.dtype,
                device=kv_c.device,
            )
            if self.static and not torch.compiler.is_compiling():
                # Fixed addresses: compiled graphs (and CUDA graphs) read them in place.
                for tensor in [*self.cache.pools, self.cache.block_table, self.cache.seqlens]:
                    torch._dynamo.mark_static_address(tensor)
        return self.cache


class MLACacheLayer(CacheLayerMixin):
    """One layer's view of the shared paged store."""

    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(self, store: _SharedStore, layer_idx: int) -> None:
        super().__init__()
        self.store, self.layer_idx = store, layer_idx
        # Static mode keeps every length on the device: a decode step compiles once.
        self.is_compileable = store.static

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.store.get(key_states, value_states)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new latents (``[B, 1, S, L]``, ``[B, 1, S, R]``); return all of them."""
        if key_states.dim() != 4 or key_states.shape[1] != 1 or value_states.shape[1] != 1:
            raise ValueError(
                "MLACache stores MLA latents [batch, 1, S, L] and [batch, 1, S, R]; got "
                f"{tuple(key_states.shape)} and {tuple(value_states.shape)}: this attention "
                "caches per-head keys and values (transformers <= 5.14 or a non-MLA layer)"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if not self.store.static and torch.compiler.is_compiling():
            raise RuntimeError(
                "MLACache(static=False) grows its pages and lengths on the host, which "
                "torch.compile would guard on at every step: use MLACache(..., static=True) "
                "with torch.compile"
            )
        cache = self.store.cache
        cache.append(self.layer_idx, key_states[:, 0], value_states[:, 0])
        # [B, T, L], [B, T, R]; static: T = capacity, zero past the length (the mask hides it)
        kv_c, k_pe = cache.rows(self.layer_idx)
        return kv_c.unsqueeze(1), k_pe.unsqueeze(1)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.store.static:
            return self.store.capacity, 0
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int | torch.Tensor:
        """Tokens cached per sequence; static mode: a 0-dim device tensor (as Hugging Face's
        ``StaticLayer``), so reading it needs no host sync and adds no guard."""
        cache = self.store.cache
        if cache is None:
            return 0
        if self.store.static:
            return cache.seqlens[self.layer_idx, 0]
        return cache.get_seq_length(self.layer_idx)

    def get_max_length(self) -> int:
        return self.store.max_length

    def reset(self) -> None:
        if self.store.cache is not None:
            self.store.cache.crop(0, layer=self.layer_idx)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.store.cache is not None:
            self.store.cache.reorder(beam_idx, layer=self.layer_idx)

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (transformers' convention: <= 0)."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop takes a negative number of tokens to remove, got {tokens_to_remove}"
            )
        if tokens_to_remove < 0 and self.store.cache is not None:
            self.store.cache.crop(tokens_to_remove, layer=self.layer_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("MLACache has a fixed batch size (batch_repeat_interleave)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("MLACache has a fixed batch size (batch_select_indices)")


class MLACache(Cache):
    """Paged latent cache for MLA models: ``generate(..., past_key_values=MLACache(config))``.

    Args:
        config: the model's config (``num_hidden_layers`` is read from it).
        max_length: most tokens per sequence (prompt plus generated).
        page_size: tokens per page.
        static: allocate every page up front (fixed tensor addresses).
        num_pages: pages per layer pool (default: enough for the batch at ``max_length``).
    """

    def __init__(
        self,
        config,
        max_length: int,
        page_size: int = 64,
        static: bool = False,
        num_pages: int | None = None,
    ) -> None:
        num_layers = config.get_text_config().num_hidden_layers
        self.store = _SharedStore(num_layers, max_length, page_size, static, num_pages)
        super().__init__(layers=[MLACacheLayer(self.store, i) for i in range(num_layers)])

    @property
    def paged(self) -> PagedLatentCache | None:
        """The storage (``None`` before the first update)."""
        return self.store.cache
