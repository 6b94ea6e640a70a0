"""What every processor shares: the commit protocol (``protocol``), the narrow context processors
see (``context``), base-table reads of a block (``blocks``), a table at a version and a transform's pinned inputs
(``table_reads``), small units committed from the driver by ``deltalake`` (``driver_writes``), a
view's keyed MERGE by either engine (``keyed_merge``) and the layout its MERGEs from the driver keep
(``merge_layout``), Spark reads and writes (``spark_io``) and
the crash points of the kill harness (``faults``).

May import: ``lineage``, ``resources``; nothing else of ``platform_assets``."""
