"""Deprecated name ``export`` for ``mla_compile.export`` (``mla_compile._legacy``)."""

from mla_compile._legacy import hand_over

hand_over(__name__)
