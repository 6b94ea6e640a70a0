"""How to reach the outside world: settings (``core``), the warehouse and JVM-free Delta log reads
(``storage``), the offset store and its lease (``state``), Spark sessions and servers (``spark``),
CDC sources (``cdc``) and the event collector and store (``intake``).

May import ``lineage``, never ``platform_assets``. Which room may import which: docs/layout.md.
"""
