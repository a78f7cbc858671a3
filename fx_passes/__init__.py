"""fx_passes: rewrite MLA attention into the absorbed, cache-compressed form that calls mla_ops.

* ``torch.compile(model, backend="mla")``: the dynamo backend (registered through the
  ``torch_dynamo_backends`` entry point; ``backend="mla_eager"`` runs the rewritten graph without
  Inductor).
* ``absorb_mla(gm)``: the same rewrite on any ``torch.fx.GraphModule``; returns an
  ``AbsorbReport``. ``RewriteOptions`` / ``mla_backend`` choose what the rewrite does.
* ``torch._dynamo.utils.counters["mla"]["absorbed_sites"]`` counts rewritten sites; the
  ``fx_passes`` logger reports every site found, rewritten or skipped (INFO).
"""

from mla_compile._legacy import hand_over

hand_over(__name__)  # imported by its deprecated bare name: becomes mla_compile.fx_passes

from .absorb import (
    DEFAULT_MAX_Q_LEN,
    AbsorbReport,
    RewriteOptions,
    SiteReport,
    absorb_mla,
    absorbed_mla_attention,
)
from .backend import mla, mla_backend, mla_eager

__all__ = [
    "DEFAULT_MAX_Q_LEN",
    "AbsorbReport",
    "RewriteOptions",
    "SiteReport",
    "absorb_mla",
    "absorbed_mla_attention",
    "mla",
    "mla_backend",
    "mla_eager",
]
