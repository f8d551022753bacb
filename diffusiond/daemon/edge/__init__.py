"""What faces clients: the three listeners (the Unix socket's HTTP API, the web page's TCP listener,
the output socket for zero-copy clients), who may use them, and every body read and document drawn.
The top of the engine: status codes are chosen here and only here, so nothing below may import it
(tests/test_layout.py)."""
