"""``python -m hyparallel`` is the ``hyparallel`` command."""

from hyparallel.cli import main

raise SystemExit(main())
