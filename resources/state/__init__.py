"""Tidemark's state: the offset store (``offsets``, ``offset_sql`` on SQLite or PostgreSQL), its
lease (``lease``) and the local PostgreSQL server (``local_pg``).

May import: ``lineage``, ``resources.core``."""
