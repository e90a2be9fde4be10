"""``python -m kvlife``: the ``kvlife`` command."""

from kvlife.cli import main

raise SystemExit(main())
