"""Event intake's outside world: the HTTP collector (``collector``), its incoming log
(``incoming_log``, locked by ``resources.core.pidlock``) and the event store and queue (``event_store``,
``event_queue``).

May import: ``lineage``, ``resources.core``, ``resources.storage``."""
