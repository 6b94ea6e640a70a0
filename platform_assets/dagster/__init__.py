"""The Dagster wiring: definitions, sensors, the IO manager, the watch and alert sensors, the
local daemon, and the CDC, intake and maintenance assets. ``import dagster`` here is the library
(every import is absolute).

May import: ``lineage``, ``resources``, every other room of ``platform_assets`` but ``demo`` and ``cli``."""
