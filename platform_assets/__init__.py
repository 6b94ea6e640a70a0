"""The processors and their wiring: the one commit protocol and what every processor shares
(``core``), facts (``facts``: step, reload), materialized views (``views``), CDC replicas
(``cdc``), event intake (``intake``), table maintenance (``maintenance``), the runner
(``engine``), the Dagster code location (``dagster``), the demo (``demo``) and the ``tidemark``
command line (``cli``).

May import ``resources`` and ``lineage``. Which room may import which: docs/layout.md.
"""
