"""Event intake processors: batch (``batch``), its worker processes (``workers``), the stream
(``stream``) and the operations on ready files (``units``).

May import: ``lineage``, ``resources``, ``platform_assets.core``."""
