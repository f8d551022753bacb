"""``python -m diffusiond``: the ``diffusiond`` command (``cli.py``) run by a given interpreter, which is how
``make demo``, ``diffusiond bench`` and the Ray replicas start a daemon: the same Python they run in, whatever
is on the PATH."""

from diffusiond.cli import main

raise SystemExit(main())
