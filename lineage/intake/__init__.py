"""Event intake, pure: the intake config (``config``), destinations and table-name templates
(``destinations``), the per-event pipeline (``pipeline``), column typing (``columns``) and request bodies
(``bodies``).

May import: ``lineage.core`` (and, for now, ``lineage.spec.loader``'s YAML line helpers)."""
