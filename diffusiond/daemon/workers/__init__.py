"""Which worker processes exist, and the engine's side of each: the pool spawns and replaces them
(``pool.py``), ``handle.py`` is the one module that knows a worker is a process, and the rest of the
engine sees only ``link.WorkerLink``, so tests can drive the engine with in-process fakes."""
