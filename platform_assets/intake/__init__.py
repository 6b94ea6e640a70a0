"""Event intake processors: batch (``batch``), its worker processes (``workers``), the stream
(``stream``), the operations on ready files (``units``) and their units in the offset store
(``record``).

May import: ``lineage``, ``resources``, ``platform_assets.core``."""
