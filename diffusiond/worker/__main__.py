"""``python -m diffusiond.worker --fd N``: the entry point the engine spawns."""

from diffusiond.worker.process import main

raise SystemExit(main())
