"""``python -m diffusiond.daemon.worker --fd N``: the entry point the engine spawns."""

from diffusiond.daemon.worker.process import main

raise SystemExit(main())
