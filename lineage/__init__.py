"""What should happen: lineage specs, their loader and validator, positions and the planner.

Pure Python: nothing in this package imports Spark or Dagster, so it loads in milliseconds
(sensor ticks and ``dagster definitions validate`` depend on that).
"""
