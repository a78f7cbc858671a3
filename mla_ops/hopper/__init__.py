"""The Hopper decode kernel, written in Gluon: warpgroup MMAs (``wgmma``) whose operands sit in
shared memory, fed by the copy engine (TMA) or ``cp.async`` gathers through a ring of tiles.

It serves ``mla::decode`` / ``mla::attention`` on compute capability 9.0 for a paged bf16/fp16
cache or a float8 e4m3 ``kv_c`` (``k_pe`` in q's dtype, or in e4m3 at width 64), with or without
an attention mask; the planner (``planner.plan_decode``) says when it takes a call and why. Same
contract as the Triton kernel (``triton_kernels``): float32 partials and their LSE per split, the
same split bounds, NaN rows for a token at an invalid cache location; or, merging in the kernel,
the attention output itself.

The files, each readable alone (``docs/kernels.md`` tells the design as a whole):

* ``layouts``: tile sizes, register and shared-memory layouts, constants the kernels share.
* ``compat``: names that moved between Gluon releases.
* ``schedule``: which chunk of which sequence a program takes (split-major or longest first).
* ``loads``: the copy ring: page lookup, TMA and gathered copies, the producer partition.
* ``query``: the absorbed query into shared memory or registers.
* ``softmax``: causal bounds, masks and the online softmax in the exp2 domain.
* ``float8``: float8 tiles converted to fp16 or multiplied in float8.
* ``mainloop_transposed``: 16/32-row programs, tokens on the MMA's M side.
* ``mainloop_rows_on_m``: 64-row programs over gathered tiles, rows on M.
* ``mainloop_one_scorer``: 64-row programs: warpgroup 0 scores, warpgroup 1 copies and helps P.V.
* ``mainloop_query_in_registers``: the one-scorer loop with the query in registers, ring of 3.
* ``epilogue``: partials, the final output, and the merge of a sequence's chunks in the kernel.
* ``kernel``: the entry: split bounds, shared memory, the choice of main loop, the epilogue.
* ``host``: the host side: a plan's ``PreparedLaunch`` and each call's data.

Importing this package imports Triton's experimental Gluon frontend: the planner imports it only
when a CUDA device qualifies.
"""

from .host import descriptor, launch, launch_data, prepare, prepared_call
from .kernel import _mla_decode_wgmma_kernel
from .layouts import BLOCK_N, GATHER_CHUNK, LONGEST_FIRST_MAX_SPLITS, MASK_HIDDEN

__all__ = [
    "BLOCK_N",
    "GATHER_CHUNK",
    "LONGEST_FIRST_MAX_SPLITS",
    "MASK_HIDDEN",
    "_mla_decode_wgmma_kernel",
    "descriptor",
    "launch",
    "launch_data",
    "prepare",
    "prepared_call",
]
