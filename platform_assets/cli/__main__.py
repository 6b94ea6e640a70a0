"""``python -m platform_assets.cli``: the ``tidemark`` command."""

from platform_assets.cli.main import run

run()
