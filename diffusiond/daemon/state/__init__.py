"""The state dir: what outlives the process. Durable jobs and their output files (``store.py``,
their rows in ``rows.py``), jobs found later and retention (``history.py``), and the lock that
keeps a second daemon out (``statedir.py``)."""
