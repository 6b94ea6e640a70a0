"""What should happen, in pure Python: the lineage model and its loader (``spec``), the planner
(``planning``), view refresh strategies (``views``), CDC change events and their reductions
(``cdc``), the event intake's config and pipeline (``intake``), and the shared vocabulary
(``core``).

Nothing in this package imports Spark, Dagster or Delta, so it loads in milliseconds (sensor ticks
and ``dagster definitions validate`` depend on that). Which room may import which: docs/layout.md.
"""
