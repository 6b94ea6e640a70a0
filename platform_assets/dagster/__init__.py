"""The Dagster wiring: definitions, sensors, the IO manager, the watch and alert sensors, the
local daemon, the CDC, intake and maintenance assets, continuous mode's ``tidemark_follow`` job and
sensor (``follow``, ``followed``), and how a unit is reported (``reports``). ``import dagster`` here is the library
(every import is absolute).

May import: ``lineage``, ``resources``, every other room of ``platform_assets`` but ``demo`` and ``cli``."""
