"""What every processor shares: the commit protocol (``protocol``), the narrow context processors
see (``context``), base-table reads of a block (``blocks``), a table at a version and a transform's pinned inputs
(``table_reads``), Spark reads and writes (``spark_io``) and
the crash points of the kill harness (``faults``).

May import: ``lineage``, ``resources``; nothing else of ``platform_assets``."""
