"""Settings, child processes, the alert notifier and a pid-file lock (``pidlock``): what every other
room of ``resources`` uses.

May import: ``lineage``; nothing else of ``resources``."""
