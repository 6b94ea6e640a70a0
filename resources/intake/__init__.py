"""Event intake's outside world: the HTTP collector (``collector``), its incoming log
(``incoming_log``), the event store and queue (``event_store``, ``event_queue``) and a pid-file lock
(``pidlock``).

May import: ``lineage``, ``resources.core``, ``resources.storage``."""
