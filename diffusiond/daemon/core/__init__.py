"""The job core: the event loop's own state. Jobs and their one ending (``engine.py``, ``jobs.py``),
batches in flight (``flights.py``), the queue (``scheduler.py``), and the inputs and adapters a job
carries (edit images, ControlNets, IP-Adapters, LoRAs, upscalers). No HTTP here: it raises the
domain errors of ``daemon/errors.py`` and the edge picks their status codes."""
