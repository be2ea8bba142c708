"""``python -m blobha``: the same command line as the ``blobha`` script."""

from __future__ import annotations

from blobha.cli import main

raise SystemExit(main())
