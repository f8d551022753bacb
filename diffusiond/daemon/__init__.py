"""The engine process: event loop, HTTP API, scheduler, jobs, worker supervision, encoders,
systemd integration; and the worker process entry point."""
