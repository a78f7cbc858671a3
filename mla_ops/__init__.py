"""mla_ops: Multi-head Latent Attention decode and combine as ``torch.library`` custom ops.

Importing this package registers ``torch.ops.mla.decode``, ``torch.ops.mla.combine`` and
``torch.ops.mla.attention`` (the two in one, which ``mla_decode`` calls), ``torch.ops.mla.prefill``
(long queries over the latent cache in bounded memory), plus the paged-cache ops
(Triton kernels on CUDA, a PyTorch implementation elsewhere, fake functions for compile/export).
"""

from mla_compile._legacy import hand_over

hand_over(__name__)  # imported by its deprecated bare name: becomes mla_compile.mla_ops

from . import context_parallel  # noqa: F401  (registers mla::cp_rows)
from .ops import (
    FP8_CACHE_DTYPE,
    SUPPORTED_DTYPES,
    mla_combine,
    mla_decode,
    quantize_kv_fp8,
    split_kv_cache,
)
from .planner import DecodeOptions, DecodePlan, plan_decode
from .prefill import PrefillPlan, plan_prefill
from .splits import SplitPlan, plan_splits

__all__ = [
    "FP8_CACHE_DTYPE",
    "SUPPORTED_DTYPES",
    "DecodeOptions",
    "DecodePlan",
    "PrefillPlan",
    "SplitPlan",
    "mla_combine",
    "mla_decode",
    "plan_decode",
    "plan_prefill",
    "plan_splits",
    "quantize_kv_fp8",
    "split_kv_cache",
]
