"""Fixtures of the resources tests: ``pg_url`` (a real PostgreSQL server for the whole session)
lives in ``tests/conftest.py``, shared with the platform tests."""
