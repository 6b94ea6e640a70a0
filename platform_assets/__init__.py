"""Dagster wiring and the Spark processors (step, reload) that run the lineage."""
