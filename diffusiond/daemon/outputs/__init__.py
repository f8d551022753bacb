"""What comes back from the workers: outputs in their arena slots, and the bytes a client fetches
(encoders, metadata, previews, trajectory files). ``slots.py`` is the one owner of slots, so every
path that gives a slot back to its worker is in one module (and ``trajectories.py`` the one owner of
the side regions beside them)."""
