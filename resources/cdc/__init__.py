"""CDC sources: PostgreSQL logical replication (``postgres``, its pgoutput decoder ``pgoutput``,
slots and publications ``pg_setup``) and Debezium change files (``debezium``).

May import: ``lineage``, ``resources.core``."""
