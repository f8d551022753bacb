"""diffusiond on Ray Serve, for a team that outgrows one machine (``pip install diffusiond[ray]``).

``serve run diffusiond.ray:build model=sd=/models/sd15 replicas=2 gpus_per_replica=1``: each
Serve replica runs one real diffusiond daemon on the GPUs Ray gave it (``replica.py``), a gateway
deployment is the HTTP ingress (``gateway.py``, behind a bearer token: ``auth.py``), job ids
carry the replica that holds the job (``ids.py``), and a custom request router sends each
request to that replica or, for new work, where its model is loaded, then by load
(``router.py``). With a state dir the replicas share, a gone replica's jobs are taken over by
another (``claims.py`` says who runs which store, ``adoption.py`` runs it). docs/scaling.md says
when this is worth it.

An adapter on top of the daemon: nothing in the daemon, the worker or the client imports it, and
``import diffusiond`` does not load Ray. Importing ``diffusiond.ray`` itself is cheap; Ray loads
when ``build`` runs.
"""

from diffusiond.ray.app import build

__all__ = ["build"]
