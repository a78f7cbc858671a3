"""Seeded random decode problems covering the op's whole input space, and dtype tolerances."""

from __future__ import annotations

import ast
import math
import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from tests.mla_ops.reference64 import mla_attention

ROOT = Path(__file__).resolve().parents[2]

# (atol, rtol) of an output against the float64 reference, by input dtype.
TOLERANCE = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (2e-5, 2e-5),
    torch.float16: (3e-3, 3e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
# LSE is accumulated in float32 from the same products in every dtype but float64.
LSE_TOLERANCE = {
    torch.float64: 1e-10,
    torch.float32: 2e-5,
    torch.float16: 2e-4,
    torch.bfloat16: 2e-4,
}


@dataclass
class DecodeCase:
    q: torch.Tensor  # [B, S_q, H, L+R]
    kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    kv_c: torch.Tensor  # view of the cache's first L columns
    k_pe: torch.Tensor  # view of the cache's last R columns
    cache_seqlens: torch.Tensor  # [B] int32
    block_table: torch.Tensor | None  # [B, max_pages] int32
    head_dim_v: int
    softmax_scale: float
    causal: bool
    num_splits: int
    kv_scale: float | None = None  # set for a float8 cache
    attn_mask: torch.Tensor | None = None  # [B, S_q, T_m] bool or float
    total_splits: int | None = None  # chunks over the batch (splits.split_bounds)

    def op_args(self) -> tuple:
        return (
            self.q,
            self.kv_c,
            self.k_pe,
            self.cache_seqlens,
            self.block_table,
            self.softmax_scale,
            self.causal,
            self.num_splits,
            self.kv_scale,
            self.attn_mask,
            self.total_splits,
        )

    def reference(self, token_range=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The float64 reference of this problem (optionally one token range per sequence)."""
        return mla_attention(
            self.q,
            self.kv_c,
            self.k_pe,
            self.cache_seqlens,
            self.block_table,
            self.softmax_scale,
            self.causal,
            token_range=token_range,
            kv_scale=self.kv_scale,
            attn_mask=self.attn_mask,
        )

    def describe(self) -> str:
        b, s, h, d = self.q.shape
        page = None if self.block_table is None else self.kv_c.shape[1]
        return (
            f"B={b} S_q={s} H={h} L={self.head_dim_v} R={d - self.head_dim_v} page={page} "
            f"lens={self.cache_seqlens.tolist()} causal={self.causal} "
            f"splits={self.num_splits}/{self.total_splits} "
            f"pair={isinstance(self.kv_cache, tuple)} dtype={self.q.dtype} "
            f"cache={self.kv_c.dtype}/{self.k_pe.dtype} "
            f"mask={None if self.attn_mask is None else self.attn_mask.dtype}"
        )


def make_case(
    seed: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    batch: int | None = None,
    s_q: int | None = None,
    heads: int | None = None,
    dims: tuple[int, int] | None = None,
    page_size: int | str | None = "random",
    causal: bool | None = None,
    num_splits: int | None = None,
    pair: bool | None = None,
    max_len: int | None = None,
    lengths: list[int] | None = None,
    cache_dtype: torch.dtype | None = None,
    mask: str | None = None,
    total_splits: int | None = None,
) -> DecodeCase:
    """A random decode problem; every argument left out is drawn from ``seed``.

    mask: ``"bool"`` or ``"float"`` adds a random ``attn_mask`` (left padding plus random holes,
    some rows fully hidden, a length that may fall short of or run past the cache); ``"random"``
    picks one of None/bool/float.
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    batch = batch if batch is not None else (len(lengths) if lengths else rng.choice([1, 2, 3, 5]))
    s_q = s_q or rng.choice([1, 1, 2, 3, 8])
    heads = heads or rng.choice([1, 3, 4, 16, 20])
    kv_len, rope_len = dims or rng.choice([(32, 16), (64, 0), (16, 16), (48, 8)])
    if page_size == "random":
        page_size = rng.choice([None, 1, 3, 16, 64])
    causal = rng.random() < 0.7 if causal is None else causal
    num_splits = num_splits or rng.choice([1, 1, 2, 3, 5])
    pair = rng.random() < 0.3 if pair is None else pair
    max_len = max_len or rng.choice([20, 70, 300, 700])
    if lengths is None:
        choices = [0, s_q, max_len, None, None]
        lengths = [
            c if c is not None else rng.randint(s_q, max_len)
            for c in (rng.choice(choices) for _ in range(batch))
        ]
    row = kv_len + rope_len

    # The cache is a slice of a wider buffer, so rows are strided (never assumed contiguous).
    pad = rng.choice([0, 8])
    if page_size is None:
        capacity = max([*lengths, 1]) + rng.randint(0, 5)
        storage = torch.randn(batch, capacity, row + pad, generator=gen)
        block_table = None
    else:
        max_pages = math.ceil(max([*lengths, 1]) / page_size) + rng.randint(0, 1)
        num_pages = batch * max_pages + rng.randint(0, 3)
        storage = torch.randn(num_pages, page_size, row + pad, generator=gen)
        # Pages of different sequences interleave; entries past a sequence's pages are junk.
        ids = torch.randperm(num_pages, generator=gen)[: batch * max_pages].reshape(
            batch, max_pages
        )
        for b, length in enumerate(lengths):
            ids[b, math.ceil(length / page_size) :] = rng.choice([-1, 10**6, 0])
        block_table = ids.to(torch.int32).to(device)
    _poison_unused(storage, lengths, None if page_size is None else ids, page_size)
    kv_scale = None
    if cache_dtype == torch.float8_e4m3fn:
        # Per-tensor scale from the live rows (the NaN poison stays NaN in e4m3fn).
        kv_scale = max(float(storage.nan_to_num(0.0).abs().amax()), 1.0) / 448.0
        cache = (storage[..., :row] / kv_scale).to(cache_dtype).to(device)
    else:
        cache = storage[..., :row].to(dtype).to(device)
    kv_c, k_pe = cache[..., :kv_len], cache[..., kv_len:]
    if pair:
        # Hugging Face keeps kv_c and k_pe in separate tensors; an fp8 cache may keep the RoPE
        # part in q's dtype (as FlashMLA's fp8 layout does).
        kv_c, k_pe = kv_c.clone(), k_pe.clone()
        if kv_scale is not None and rng.random() < 0.5:
            k_pe = (k_pe.float() * kv_scale).to(dtype)
        kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor] = (kv_c, k_pe)
    else:
        kv_cache = cache
    q = torch.randn(batch, s_q, heads, row, generator=gen).to(dtype).to(device)
    if mask == "random":
        mask = rng.choice([None, "bool", "float"])
    attn_mask = None if mask is None else _random_mask(rng, gen, batch, s_q, lengths, mask)
    return DecodeCase(
        q=q,
        kv_cache=kv_cache,
        kv_c=kv_c,
        k_pe=k_pe,
        cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device=device),
        block_table=block_table,
        head_dim_v=kv_len,
        softmax_scale=rng.uniform(0.5, 2.0) / math.sqrt(row),
        causal=causal,
        num_splits=num_splits,
        kv_scale=kv_scale,
        attn_mask=None if attn_mask is None else attn_mask.to(device),
        total_splits=total_splits,
    )


def _random_mask(
    rng: random.Random,
    gen: torch.Generator,
    batch: int,
    s_q: int,
    lengths: list[int],
    kind: str,
) -> torch.Tensor:
    """``[B, S_q, T_m]`` mask: left padding per sequence, random holes, a fully hidden row."""
    mask_len = max([*lengths, 1]) + rng.choice([-3, 0, 0, 4])
    mask_len = max(mask_len, 1)
    visible = torch.rand(batch, s_q, mask_len, generator=gen) > 0.2
    for b in range(batch):
        visible[b, :, : rng.randint(0, max(lengths[b] // 2, 0))] = False  # left padding
    if rng.random() < 0.5:
        visible[rng.randrange(batch), rng.randrange(s_q)] = False  # a row that sees nothing
    if kind == "bool":
        return visible
    bias = torch.randn(batch, s_q, mask_len, generator=gen)
    # Hugging Face's eager masks use the dtype's most negative value; -inf must work as well.
    hidden = rng.choice([float("-inf"), torch.finfo(torch.float32).min])
    return torch.where(visible, bias, hidden)


def _poison_unused(
    storage: torch.Tensor, lengths: list[int], ids: torch.Tensor | None, page_size: int | None
) -> None:
    """Fill every cache row no sequence owns with NaN: stale memory must never reach an output."""
    if ids is None:
        for b, length in enumerate(lengths):
            storage[b, length:] = float("nan")
        return
    owned = torch.zeros(storage.shape[:2], dtype=torch.bool)
    for b, length in enumerate(lengths):
        for t in range(length):
            owned[ids[b, t // page_size], t % page_size] = True
    storage[~owned] = float("nan")


def assert_matches(
    out: torch.Tensor,
    lse: torch.Tensor,
    ref_out: torch.Tensor,
    ref_lse: torch.Tensor,
    dtype: torch.dtype,
    context: str = "",
    tolerance: tuple[float, float] | None = None,
    lse_tolerance: float | None = None,
) -> None:
    """Output and LSE against the float64 reference; empty rows must be exactly 0 and -inf.
    ``tolerance`` ``(atol, rtol)`` and ``lse_tolerance`` replace ``dtype``'s."""
    atol, rtol = tolerance or TOLERANCE[dtype]
    out64, lse64 = out.detach().cpu().double(), lse.detach().cpu().double()
    assert not torch.isnan(out64).any(), f"NaN in output: {context}"
    assert not torch.isnan(lse64).any(), f"NaN in lse: {context}"
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse64), empty), f"-inf pattern of lse differs: {context}"
    assert (out64[empty] == 0).all(), f"empty rows are not zero: {context}"
    torch.testing.assert_close(
        out64, ref_out, atol=atol, rtol=rtol, msg=lambda m: f"{context}\n{m}"
    )
    lse_tol = lse_tolerance or LSE_TOLERANCE[dtype]
    torch.testing.assert_close(
        lse64[~empty], ref_lse[~empty], atol=lse_tol, rtol=lse_tol, msg=lambda m: f"{context}\n{m}"
    )


def poison_hidden_keys(case: DecodeCase) -> None:
    """Write NaN into every cached key that ``case.attn_mask`` hides from all queries (dense cache).

    Hugging Face's float64 eager prefill leaves NaN at left-pad positions; they must not leak.
    """
    assert case.block_table is None and case.attn_mask is not None
    hidden = (
        ~case.attn_mask.bool().any(dim=1)
        if case.attn_mask.dtype == torch.bool
        else (case.attn_mask <= -1e30).all(dim=1)
    )  # [B, T_m]
    for b, length in enumerate(case.cache_seqlens.tolist()):
        for t in range(min(length, hidden.shape[1])):
            if hidden[b, t]:
                case.kv_c[b, t] = float("nan")
                case.k_pe[b, t] = float("nan")


# For an offline compile's statements, with its PTX in ``ptx`` and a dict ``r``: the decode
# kernel's combine launch triggers as ``r['trigger']`` = [how many, whether the PTX has an MMA at
# all, whether the first trigger comes after every MMA and MMA wait (after the loop, not at the
# program's entry)]. Both decode kernels expect [1, True, True].
TRIGGER_AFTER_LOOP = (
    "g = 'griddepcontrol.launch_dependents'; "
    "last = max(ptx.rfind(m) for m in ('wgmma.mma_async', 'wgmma.wait_group', 'mma.sync')); "
    "r['trigger'] = [ptx.count(g), last > 0, ptx.find(g) > last]; "
)


def offline_compile(statements: str):
    """Run ``statements`` (with ``benchmarks/offline_compile.py`` imported as ``oc``) in a fresh
    process, which needs Triton's compiler, not the interpreter the suite turns on; returns the
    literal its last printed line holds."""
    code = "import sys; sys.path.insert(0, 'benchmarks'); import offline_compile as oc; "
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-c", code + statements], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return ast.literal_eval(run.stdout.strip().splitlines()[-1])
