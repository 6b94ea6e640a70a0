"""The ``tidemark`` command line: the parser and the topic, table and server commands (``main``),
what commands share (``common``), and the ``cdc`` and ``events`` sub-commands.
``python -m platform_assets.cli`` runs it.

May import: everything."""
