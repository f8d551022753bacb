"""The state dir: what outlives the process. Durable jobs and their output files (``store.py``,
their rows in ``rows.py``, the database opened or refused at start in ``database.py``), jobs found
later and retention (``history.py``), and the lock that keeps a second daemon out (``statedir.py``)."""
