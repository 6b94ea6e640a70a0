"""The demo: the shop lineage (``shop``), its feeder (``feeder``), and the events and CDC demos.

May import: ``lineage``, ``resources``, every other room of ``platform_assets`` but ``cli``."""
