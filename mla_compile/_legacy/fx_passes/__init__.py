"""Deprecated name ``fx_passes`` for ``mla_compile.fx_passes`` (``mla_compile._legacy``)."""

from mla_compile._legacy import hand_over

hand_over(__name__)
