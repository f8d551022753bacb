"""``diffusiond.zerocopy``, the name docs/api.md has always given the zero-copy client; the code
lives in ``diffusiond.client.zerocopy`` with the rest of the client library."""

from diffusiond.client.zerocopy import OutputMapper, ZeroCopyUnavailable

__all__ = ["OutputMapper", "ZeroCopyUnavailable"]
