"""torch.library.opcheck on every op in the ``mla`` namespace.

The ops are enumerated from the dispatcher, so a newly registered op without samples fails here.
"""

from __future__ import annotations

import pytest
import torch

from mla_compile import mla_ops  # noqa: F401  (registers the ops)
from tests.conftest import HAS_CUDA
from tests.mla_ops.cases import make_case

DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])


def decode_samples(device: str):
    for kw in (
        dict(page_size=None, s_q=1, dims=(32, 16)),
        dict(page_size=1, s_q=2, dims=(32, 16), causal=True),
        dict(page_size=16, s_q=3, dims=(64, 0), causal=False),
        dict(page_size=16, s_q=1, dims=(16, 16), dtype=torch.bfloat16, lengths=[0, 40]),
        dict(page_size=None, s_q=1, dims=(16, 16), dtype=torch.float16, num_splits=3),
        dict(page_size=3, s_q=2, dims=(16, 16), mask="bool"),
        dict(page_size=None, s_q=1, dims=(16, 16), mask="float", lengths=[3, 30]),
        dict(page_size=16, s_q=1, dims=(16, 16), lengths=[0, 40, 7], num_splits=4, total_splits=2),
    ):
        yield make_case(21, device=device, max_len=40, **kw).op_args()


# opcheck's test_schema multiplies the inputs, which torch's CPU kernels do not implement for
# float8 ("mul_cpu_reduced_float"); the fp8 sample runs every other opcheck test.
ALL_BUT_SCHEMA = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def decode_fp8_samples(device: str):
    kw = dict(page_size=16, s_q=2, dims=(32, 16), cache_dtype=torch.float8_e4m3fn)
    yield make_case(22, device=device, max_len=40, **kw).op_args()


def combine_samples(device: str):
    lse = torch.randn(2, 3, 4, device=device)
    lse[0, 0] = float("-inf")
    yield (torch.randn(2, 3, 4, 16, device=device), lse, None)
    yield (torch.randn(5, 1, 8, device=device), torch.randn(5, 1, device=device), torch.bfloat16)
    yield (
        torch.randn(2, 2, 8, dtype=torch.float64, device=device),
        torch.randn(2, 2, dtype=torch.float64, device=device),
        None,
    )


def paged_samples(device: str):
    """``(pool, block_table, cache_seqlens)`` with every table entry a valid page."""
    gen = torch.Generator().manual_seed(24)
    for page_size, lengths in ((1, [0, 4]), (3, [7, 2]), (4, [8, 8])):
        max_pages = 4
        pool = torch.randn(2 * max_pages + 1, page_size, 24, generator=gen).to(device)
        table = torch.randperm(pool.shape[0], generator=gen)[: 2 * max_pages].reshape(2, -1)
        lengths = torch.tensor(lengths, dtype=torch.int32)
        yield pool, table.to(torch.int32).to(device), lengths.to(device)


def paged_rows_samples(device: str):
    yield from paged_samples(device)


def paged_append_samples(device: str):
    for pool, block_table, cache_seqlens in paged_samples(device):
        new = 2
        capacity = block_table.shape[1] * pool.shape[1]
        lengths = cache_seqlens.clamp_max(capacity - new)
        rows = torch.randn(block_table.shape[0], new, pool.shape[2], device=device)
        yield (pool, block_table, lengths, rows)


def paged_write_samples(device: str):
    """Positions in order, out of order and skipped (-1); the pool's last page kept out of the
    block table (scratch)."""
    gen = torch.Generator().manual_seed(25)
    for page_size in (1, 4):
        pool = torch.randn(2 * 4 + 1, page_size, 24, generator=gen).to(device)
        table = torch.randperm(8, generator=gen).reshape(2, 4).to(torch.int32).to(device)
        positions = torch.tensor([[0, 3, -1], [2, -1, 1]], dtype=torch.int64).to(device)
        yield pool, table, positions, torch.randn(2, 3, 24, generator=gen).to(device)


def prefill_samples(device: str):
    """Dense and paged, masks bool and float, S = 1 and several chunks (float32: the CPU flash
    kernel; on CUDA the fused kernels where head dims allow)."""
    from tests.mla_ops.test_prefill import random_case

    for seed in (1, 2, 3, 200, 204):
        args, chunk_tokens, _ = random_case(seed, torch.float32)
        args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
        yield (*args, chunk_tokens)


SAMPLES = {
    "mla::attention": decode_samples,  # the same arguments
    "mla::decode": decode_samples,
    "mla::combine": combine_samples,
    "mla::paged_rows": paged_rows_samples,
    "mla::paged_append": paged_append_samples,
    "mla::paged_write": paged_write_samples,
    "mla::prefill": prefill_samples,
}
# Ops that exist only to be rewritten in a traced graph: running one is an error (tested in
# tests/mla_ops/test_paged_ops.py), so opcheck cannot run them.
MARKERS = {"mla::expanded_kv_update"}
# Ops that call a collective: opcheck runs them on every rank of a process group, in
# tests/mla_ops/test_context_parallel.py.
COLLECTIVES = {"mla::cp_rows"}


def registered_mla_ops() -> list[str]:
    return sorted(
        {n.split(".")[0] for n in torch._C._dispatch_get_all_op_names() if n.startswith("mla::")}
    )


def test_every_registered_op_has_samples() -> None:
    ops = registered_mla_ops()
    known = sorted([*SAMPLES, *MARKERS, *COLLECTIVES])
    assert ops == known, f"ops {ops} vs samples {sorted(SAMPLES)}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_opcheck(name: str, device: str) -> None:
    namespace, op_name = name.split("::")
    op = getattr(getattr(torch.ops, namespace), op_name).default
    for args in SAMPLES[name](device):
        torch.library.opcheck(op, args)
    if name in ("mla::decode", "mla::attention"):
        for args in decode_fp8_samples(device):
            torch.library.opcheck(op, args, test_utils=ALL_BUT_SCHEMA)
