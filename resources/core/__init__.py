"""Settings, child processes, the alert notifier, a pid-file lock (``pidlock``) and a bounded
least-recently-used map (``lru``): what every other
room of ``resources`` uses.

May import: ``lineage``; nothing else of ``resources``."""
