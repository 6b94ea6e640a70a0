"""Settings, child processes and the alert notifier: what every other room of ``resources`` uses.

May import: ``lineage``; nothing else of ``resources``."""
