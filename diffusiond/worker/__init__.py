"""The worker process: one per (model, device), spawned by the engine or forked from its template
(``template.py``, issue 27), connected by one channel.

A process of its own so that torch, CUDA and a model's crash stay out of the engine: a worker that
dies or hangs is replaced, and every job it held ends with the reason (daemon/workers/pool.py).

Three threads, each with one job:

- the event loop thread (``process``) owns the channel and is its only writer; it reads commands;
- the compute thread (``compute``) runs forward passes back to back on the default CUDA stream;
- the copy thread (``copier``) moves each finished output off the device into an arena slot on a
  side stream, while the compute thread is already on the next batch.

Threads hand frames to the loop with ``Channel.post_threadsafe``; nothing else writes.

``faults`` holds the test-only fault injection (``WorkerConfig.fault``); ``process`` imports and
installs it only when a fault is set, so a normal run checks for none.
"""
