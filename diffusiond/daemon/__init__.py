"""The engine process: one event loop that admits jobs, hands batches to worker processes and
serves what comes back. It never imports torch (a subprocess test holds it), so it starts in a
fraction of a second and holds no CUDA context; the worker processes (``diffusiond.worker``) do the
forwards.

Its rooms, one concern each: ``edge/`` (everything that faces a client; status codes are chosen
there and only there), ``core/`` (the loop's state: jobs, batches in flight, the queue, the inputs
and adapters a job carries), ``workers/`` (which worker processes exist), ``outputs/`` (what comes
back: arena slots and the bytes made of them), ``state/`` (what outlives the process) and
``residency/`` (which model is where, within which budget). ``server.py`` wires them together;
docs/architecture.md has the map and which way imports go.
"""
