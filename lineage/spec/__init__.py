"""The lineage model (``model``: topics, tables, replicators) and its YAML loader and validator
(``loader``).

May import: ``lineage.core``, ``lineage.cdc``."""
