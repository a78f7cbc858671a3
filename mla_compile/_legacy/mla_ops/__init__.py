"""Deprecated name ``mla_ops`` for ``mla_compile.mla_ops`` (``mla_compile._legacy``)."""

from mla_compile._legacy import hand_over

hand_over(__name__)
