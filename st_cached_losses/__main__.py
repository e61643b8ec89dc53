"""``python -m st_cached_losses``: the same command line as the ``st-cached-losses`` script."""

from st_cached_losses.cli.command import main

raise SystemExit(main())
