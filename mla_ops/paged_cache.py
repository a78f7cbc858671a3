"""Paged latent storage in the layout ``mla_decode`` reads: one ``[kv_c | k_pe]`` row per token.

``PagedLatentCache`` keeps, per layer, a pool of pages ``[num_pages, page_size, L+R]``, and for the
batch one block table ``[B, max_pages]`` (int32 page ids, shared by all layers) and per-layer
lengths. It is the storage under a Hugging Face cache (``hf_cache.MLACache``); it knows nothing of
transformers.

* ``static=True`` allocates every sequence's pages up front and keeps the lengths only on the
  device: no tensor ever changes address and ``append`` takes its write positions from the device
  lengths, so a decode step compiles once and can be captured in a CUDA graph (no host sync, no
  value that changes per step on the host). ``static=False`` takes pages from a free list as
  sequences grow (a host-side allocator and host-side lengths: eager use only).
* Every sequence owns its pages: no page is ever in two rows of the block table.
* All sequences of the batch advance together (as in ``generate()``, where padding is a token).
* A DeepSeek Sparse Attention model's indexer keys (``index_len`` per token) live in pools of
  their own on the same pages, addressed by the same block table and lengths.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from . import ops  # noqa: F401  (registers mla::paged_rows / paged_append, used below)


def capacity_for(max_length: int, page_size: int) -> int:
    """Token positions one sequence's block-table row addresses: ``max_length`` rounded up to
    whole pages."""
    return math.ceil(max_length / page_size) * page_size


def cropped_lengths(lengths: dict[int, int], max_length: int) -> dict[int, int]:
    """The tokens each layer keeps (``{layer: length}`` in and out) when cropped to its first
    ``max_length`` (negative: dropping that many); every layer is checked before any is cropped."""
    keeps = {}
    for index, length in lengths.items():
        keep = length + max_length if max_length < 0 else min(length, max_length)
        if keep < 0:
            raise ValueError(
                f"cannot crop {-max_length} tokens from layer {index}'s {length}-token cache"
            )
        keeps[index] = keep
    return keeps


class PagedLatentCache:
    """Latent rows of ``num_layers`` layers for a batch of ``batch_size`` sequences.

    Args:
        num_layers: layers stored.
        batch_size: sequences (B).
        kv_len, rope_len: L and R of a row (DeepSeek-V3: 512, 64).
        max_length: most tokens one sequence may hold.
        page_size: tokens per page (64 is what the kernel's copy-engine path wants).
        num_pages: pages per layer pool; default: enough for every sequence at ``max_length``.
        static: allocate all pages up front (fixed addresses, CUDA-graph friendly).
        index_len: width of the sparse-attention indexer's key kept per token beside the
            latent (DeepSeek Sparse Attention; 0: none), in pools of its own with the same
            pages, block table and lengths.
        index_layers: the layers that keep indexer keys (default: all, when ``index_len``).
    """

    def __init__(
        self,
        *,
        num_layers: int,
        batch_size: int,
        kv_len: int,
        rope_len: int,
        max_length: int,
        page_size: int = 64,
        num_pages: int | None = None,
        static: bool = False,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        index_len: int = 0,
        index_layers: Sequence[int] | None = None,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("batch_size", batch_size),
            ("kv_len", kv_len),
            ("max_length", max_length),
            ("page_size", page_size),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name, value in (("rope_len", rope_len), ("index_len", index_len)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        self.kv_len, self.rope_len, self.page_size = kv_len, rope_len, page_size
        self.batch_size, self.max_length = batch_size, max_length
        self.static = static
        self.dtype = dtype
        # The device with its index ("cuda" is the current device, "cuda:0" here): tensors report
        # theirs with one, and the checks compare devices.
        self.device = torch.empty(0, device=device).device
        self.pages_per_seq = math.ceil(max_length / page_size)
        needed = batch_size * self.pages_per_seq
        num_pages = needed if num_pages is None else num_pages
        if static and num_pages < needed:
            raise ValueError(
                f"static cache needs {needed} pages ({batch_size} sequences x "
                f"{self.pages_per_seq} pages of {page_size} for max_length={max_length}), "
                f"got num_pages={num_pages}"
            )
        self.num_pages = num_pages
        row = kv_len + rope_len
        # [num_pages, page_size, L+R] per layer: the kv_cache argument of mla_decode.
        self.pools = [
            torch.empty(num_pages, page_size, row, dtype=dtype, device=self.device)
            for _ in range(num_layers)
        ]
        # [num_pages, page_size, index_len] per layer that keeps indexer keys (None elsewhere):
        # the same pages as the latents, so every batch operation moves both alike.
        indexed = set(range(num_layers) if index_layers is None else index_layers)
        if index_len and not indexed <= set(range(num_layers)):
            raise ValueError(f"index_layers must be layers of [0, {num_layers}), got {indexed}")
        self.index_len = index_len
        self.index_pools: list[torch.Tensor | None] = [
            torch.empty(num_pages, page_size, index_len, dtype=dtype, device=self.device)
            if index_len and layer in indexed
            else None
            for layer in range(num_layers)
        ]
        # [B, pages_per_seq] int32; -1 marks a page not allocated (never read by the kernel).
        self.block_table = torch.full(
            (batch_size, self.pages_per_seq), -1, dtype=torch.int32, device=self.device
        )
        # [num_layers, B] int32: tokens stored per sequence and layer (the S_q new ones included).
        self.seqlens = torch.zeros(num_layers, batch_size, dtype=torch.int32, device=self.device)
        # Host mirror of the lengths (every sequence has the same length); growing mode only: a
        # static cache reads its lengths from the device tensor, so nothing host-side changes.
        self._lengths = [0] * num_layers
        self._pages_allocated = 0  # pages per sequence currently in the block table
        self._free = list(range(num_pages - 1, -1, -1))  # a stack of page ids
        self._owned: list[list[int]] = [[] for _ in range(batch_size)]
        if static:
            self._allocate_pages(self.pages_per_seq)

    # --- sizes --------------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self.pools)

    def bytes_per_token_per_layer(self) -> int:
        """Bytes one token's latent occupies in one layer: ``(L+R) * element size``."""
        return (self.kv_len + self.rope_len) * self.pools[0].element_size()

    def index_bytes_per_token(self) -> int:
        """Bytes one token's indexer keys occupy, summed over the layers that keep them."""
        return sum(p.shape[-1] * p.element_size() for p in self.index_pools if p is not None)

    @property
    def all_pools(self) -> list[torch.Tensor]:
        """Every pool the block table addresses: the latents', then the indexer keys'."""
        return [*self.pools, *(p for p in self.index_pools if p is not None)]

    def fixed_tensors(self) -> list[torch.Tensor]:
        """The tensors a compiled step reads in place (static mode): pools, block table,
        lengths."""
        return [*self.all_pools, self.block_table, self.seqlens]

    @property
    def capacity(self) -> int:
        """Token positions one sequence's block-table row addresses (``capacity_for``)."""
        return capacity_for(self.max_length, self.page_size)

    def get_seq_length(self, layer: int = 0) -> int:
        """Tokens stored per sequence in ``layer`` (a host read of the device length when
        static)."""
        return int(self.seqlens[layer, 0]) if self.static else self._lengths[layer]

    # --- the arguments of mla_decode ----------------------------------------------------------

    def decode_args(self, layer: int) -> dict:
        """``kv_cache``, ``cache_seqlens`` and ``block_table`` of ``layer`` for ``mla_decode``."""
        return {
            "kv_cache": self.pools[layer],
            "cache_seqlens": self.seqlens[layer],
            "block_table": self.block_table,
        }

    # --- writing ------------------------------------------------------------------------------

    def append(self, layer: int, kv_c: torch.Tensor, k_pe: torch.Tensor) -> None:
        """Store ``S`` new rows per sequence: ``kv_c [B, S, L]``, ``k_pe [B, S, R]``."""
        self._check_rows(kv_c, k_pe)
        if self.static:
            self._append_at_device_lengths(layer, kv_c, k_pe)
            return
        new = kv_c.shape[1]
        start = self._lengths[layer]
        end = start + new
        if end > self.max_length:
            raise ValueError(
                f"cache capacity exceeded: {start} + {new} tokens > max_length={self.max_length}"
            )
        self._allocate_pages(math.ceil(end / self.page_size))
        rows = torch.cat([kv_c, k_pe], dim=-1)  # [B, S, L+R]
        # the device lengths equal the host ones (start) here; paged_append advances them
        torch.ops.mla.paged_append(self.pools[layer], self.block_table, self.seqlens[layer], rows)
        self._lengths[layer] = end

    def _append_at_device_lengths(self, layer: int, kv_c: torch.Tensor, k_pe: torch.Tensor) -> None:
        """Static mode: positions from the device lengths (compiles once; no host read under
        torch.compile)."""
        lengths = self.seqlens[layer]  # [B] int32
        new = kv_c.shape[1]
        if not torch.compiler.is_compiling() and (layer == 0 or self.device.type != "cuda"):
            # A host read: on CUDA a sync, so once per step (layer 0; every layer advances
            # together); under torch.compile none at all (see paged_append for what happens).
            end = int(lengths.max()) + new
            if end > self.max_length:
                raise ValueError(
                    f"cache capacity exceeded: {end - new} + {new} tokens > "
                    f"max_length={self.max_length} (static cache)"
                )
        rows = torch.cat([kv_c, k_pe], dim=-1)  # [B, S, L+R]
        torch.ops.mla.paged_append(self.pools[layer], self.block_table, lengths, rows)

    def append_index(self, layer: int, keys: torch.Tensor) -> None:
        """Store the indexer keys ``[B, S, index_len]`` of the ``S`` tokens ``layer`` stored last
        (``append`` came first: DeepSeek Sparse Attention caches the latents, then runs its
        indexer), at the same positions; the lengths do not move."""
        pool = self._index_pool(layer)
        if keys.dim() != 3 or keys.shape[0] != self.batch_size or keys.shape[2] != self.index_len:
            raise ValueError(
                f"indexer keys must be [batch={self.batch_size}, S, {self.index_len}], got "
                f"{tuple(keys.shape)}"
            )
        # paged_append writes at the lengths it is given and advances them: a copy, so the
        # layer's own lengths (already past these tokens) stay.
        start = self.seqlens[layer] - keys.shape[1]  # [B] int32
        torch.ops.mla.paged_append(pool, self.block_table, start, keys)

    def index_rows(self, layer: int) -> torch.Tensor:
        """All stored indexer keys of ``layer`` in token order, ``[B, T, index_len]``, ``T`` as
        in ``rows`` (static: the capacity, zero past the length)."""
        return self._gather(self._index_pool(layer), layer)

    def _index_pool(self, layer: int) -> torch.Tensor:
        pool = self.index_pools[layer]
        if pool is None:
            raise ValueError(f"layer {layer} keeps no indexer keys (index_len / index_layers)")
        return pool

    def _gather(self, pool: torch.Tensor, layer: int) -> torch.Tensor:
        """``pool``'s rows of ``layer``'s sequences in token order (see ``rows``)."""
        if self.static:
            return torch.ops.mla.paged_rows(pool, self.block_table, self.seqlens[layer])
        length = self._lengths[layer]
        pages = self.block_table[:, : math.ceil(length / self.page_size)].long()  # [B, n]
        return pool[pages].flatten(1, 2)[:, :length]  # [B, T, D]

    def rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All stored rows of ``layer`` in token order: ``kv_c [B, T, L]``, ``k_pe [B, T, R]``.

        A gather (copy): for an unrewritten model that attends over full tensors. Growing mode:
        ``T`` is the length. Static mode: ``T`` is the capacity (fixed shapes, as Hugging Face's
        static cache), rows past the length are zero, through ``mla::paged_rows``, which
        ``fx_passes`` replaces by ``mla_decode`` over the pages.
        """
        gathered = self._gather(self.pools[layer], layer)  # [B, T, L+R]
        return gathered[..., : self.kv_len], gathered[..., self.kv_len :]

    # --- batch operations (generate(): beam search, assisted decoding, reuse) -----------------

    def reorder(self, beam_idx: torch.Tensor, layer: int | None = None) -> None:
        """Sequence ``i`` becomes a copy of sequence ``beam_idx[i]`` (beam search), in place.

        Rows are copied page by page into each sequence's own pages: pages are never shared.
        ``layer``: only that layer (all layers by default).
        """
        if beam_idx.dim() != 1 or beam_idx.shape[0] != self.batch_size:
            raise ValueError(f"beam_idx must be [batch={self.batch_size}], got {beam_idx.shape}")
        if beam_idx.dtype == torch.bool or beam_idx.is_floating_point() or beam_idx.is_complex():
            raise TypeError(f"beam_idx must hold integer sequence indices, got {beam_idx.dtype}")
        if beam_idx.numel() and (int(beam_idx.min()) < 0 or int(beam_idx.max()) >= self.batch_size):
            # A negative index would wrap around to another sequence's rows.
            raise ValueError(
                f"beam_idx must be sequence indices in [0, {self.batch_size}), got "
                f"{beam_idx.tolist()}"
            )
        used = self._pages_allocated
        if used == 0:
            return
        index = beam_idx.to(self.device, torch.long)
        mine = self.block_table[:, :used].long()  # [B, n]
        if layer is None:
            pools = self.all_pools
        else:
            pools = [p for p in (self.pools[layer], self.index_pools[layer]) if p is not None]
        for pool in pools:
            pool[mine] = pool[mine[index]]  # the right side is gathered first: a safe copy

    def regroup(self, sources: torch.Tensor) -> None:
        """A new batch whose sequence ``i`` is a copy of sequence ``sources[i]`` (any length:
        batch selection, or ``repeat_interleave`` for several samples per prompt).

        Rows are copied into the new sequences' own pages; pages are never shared. The block
        table and length tensors are replaced (new addresses: a compiled step recompiles once).
        A static cache needs ``len(sources) x pages_per_seq`` pages in its pools.
        """
        sources = torch.as_tensor(sources, dtype=torch.long).reshape(-1)
        if sources.numel() == 0 or int(sources.min()) < 0 or int(sources.max()) >= self.batch_size:
            raise ValueError(
                f"sources must be indices in [0, {self.batch_size}), got {sources.tolist()}"
            )
        new_batch = sources.numel()
        needed = new_batch * (self.pages_per_seq if self.static else self._pages_allocated)
        if needed > self.num_pages:
            raise ValueError(
                f"a batch of {new_batch} needs {needed} pages, the pools hold {self.num_pages}"
            )
        used = self._pages_allocated
        old_pages = self.block_table[:, :used].long().cpu()  # [B, n]
        # Gather every source's rows first (a copy), then lay the new batch out.
        rows = [pool[old_pages[sources].to(self.device)] for pool in self.all_pools]
        seqlens = self.seqlens[:, sources.to(self.device)].clone()
        self._free = list(range(self.num_pages - 1, -1, -1))
        self._owned = [[] for _ in range(new_batch)]
        self._pages_allocated = 0
        self.batch_size = new_batch
        self.block_table = torch.full(
            (new_batch, self.pages_per_seq), -1, dtype=torch.int32, device=self.device
        )
        self._allocate_pages(self.pages_per_seq if self.static else used)
        new_pages = self.block_table[:, :used].long()
        for pool, copied in zip(self.all_pools, rows, strict=True):
            pool[new_pages] = copied
        self.seqlens = seqlens

    def crop(self, max_length: int, layer: int | None = None) -> None:
        """Keep the first ``max_length`` tokens of every sequence (negative: drop that many).

        ``layer``: only that layer (all layers by default).
        """
        layers = range(self.num_layers) if layer is None else [layer]
        keeps = cropped_lengths({index: self.get_seq_length(index) for index in layers}, max_length)
        for index, keep in keeps.items():
            self._lengths[index] = keep
            self.seqlens[index].fill_(keep)
        if not self.static:
            self._release_pages_beyond(math.ceil(max(self._lengths) / self.page_size))

    def reset(self) -> None:
        """Empty every sequence (static pages stay allocated; dynamic ones return to the pool)."""
        self.crop(0)

    # --- internals ------------------------------------------------------------------------------

    def _check_rows(self, kv_c: torch.Tensor, k_pe: torch.Tensor) -> None:
        for name, t, width in (("kv_c", kv_c, self.kv_len), ("k_pe", k_pe, self.rope_len)):
            if not isinstance(t, torch.Tensor) or t.dim() != 3:
                raise ValueError(f"{name} must be a [batch, S, {width}] tensor")
            if t.shape[0] != self.batch_size or t.shape[2] != width:
                raise ValueError(
                    f"{name} must be [batch={self.batch_size}, S, {width}], got {tuple(t.shape)}"
                )
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device}, the cache on {self.device}")
            if t.dtype != self.dtype:
                raise TypeError(f"{name} is {t.dtype}, the cache stores {self.dtype}")
        if kv_c.shape[1] != k_pe.shape[1]:
            raise ValueError(f"kv_c has {kv_c.shape[1]} new tokens, k_pe {k_pe.shape[1]}")

    def _allocate_pages(self, pages_per_seq: int) -> None:
        """Give every sequence pages up to ``pages_per_seq`` (host allocator, one table update)."""
        if pages_per_seq <= self._pages_allocated:
            return
        wanted = (pages_per_seq - self._pages_allocated) * self.batch_size
        if wanted > len(self._free):
            raise RuntimeError(
                f"page pool exhausted: {wanted} more pages needed, {len(self._free)} free of "
                f"{self.num_pages} (raise num_pages)"
            )
        for owned in self._owned:
            while len(owned) < pages_per_seq:
                owned.append(self._free.pop())
        table = torch.tensor(
            [owned[self._pages_allocated : pages_per_seq] for owned in self._owned],
            dtype=torch.int32,
        )
        self.block_table[:, self._pages_allocated : pages_per_seq] = table.to(self.device)
        self._pages_allocated = pages_per_seq

    def _release_pages_beyond(self, pages_per_seq: int) -> None:
        if pages_per_seq >= self._pages_allocated:
            return
        for owned in self._owned:
            while len(owned) > pages_per_seq:
                self._free.append(owned.pop())
        self.block_table[:, pages_per_seq:] = -1
        self._pages_allocated = pages_per_seq
