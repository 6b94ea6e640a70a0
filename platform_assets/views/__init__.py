"""Materialized views: the merge processor (``merge``: a unit opened, derived, written and
committed, and the full recompute), its JVM-free planning (``plan``), what a unit carries between
them (``work``), its strategies (``reverse``: the reverse join and the literal lists that narrow a
unit's reads; ``additive``: contributions added to a view's sums; ``row_wise``: rows re-derived
alone, appended, or found in the view itself; ``in_hand``: a row-wise unit's rows checked and
turned into its MERGE's source in the driver, from Arrow; ``driver_unit``: a unit of an additive or
row-wise view run without Spark, its transform by DuckDB where ``driver_sql`` finds the SQL in the
form both engines run alike; ``indexes``: the join indexes views declare, written by ``tidemark
maintain``), the ``exact`` check (``verify``) and the operations outside a unit
(``operate``).

Inside the room the imports point one way: ``operate`` imports ``merge``; ``merge`` imports
``plan``, ``work`` and the strategies; ``additive`` and ``row_wise`` import ``reverse``; the
strategies import ``work``; ``row_wise`` imports ``in_hand``, which imports nothing of the room;
``driver_unit`` imports ``driver_sql`` (nothing of the room, no Spark), ``additive``, ``row_wise``,
``reverse`` and ``work``; ``indexes`` imports ``driver_unit``. None imports ``merge``. A unit's pinned inputs are
``platform_assets.core.table_reads.pin_inputs``.

May import: ``lineage``, ``resources``, ``platform_assets.core``."""
