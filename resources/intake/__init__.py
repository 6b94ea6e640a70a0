"""Event intake's outside world: the HTTP collector (``collector``), its incoming log
(``incoming_log``), the event store and queue (``event_store``, ``event_queue``) and the collector's pid-file lock
(``pidlock``).

May import: ``lineage``, ``resources.core``, ``resources.storage``."""
