"""An output a format cannot hold fails its job with a reason that says so and what to ask for instead.

An upscaled output may be 16384 pixels a side (edge/upscale.py's ``MAX_SIDE``) and WebP holds 16383 at most:
such a job computed, then failed at its encoding with libwebp's "encoding error 5" and a second line naming a
larger limit than the first, and nothing a person could act on.
"""

from __future__ import annotations

import numpy as np
import pytest

from diffusiond.daemon.outputs.encoders import encode


@pytest.mark.parametrize("shape", [(8, 16384, 3), (16384, 8, 3), (2, 8, 16384, 3)])
def test_an_output_wider_than_webp_holds_is_refused_naming_the_limit_and_what_to_ask_for(
        shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=r"webp holds at most 16383 pixels a side.*png") as caught:
        encode(np.zeros(shape, np.uint8), "webp")
    assert "16384" in str(caught.value)  # the output's own size


def test_the_widest_picture_webp_holds_still_encodes() -> None:
    assert encode(np.zeros((8, 16383, 3), np.uint8), "webp")[:4] == b"RIFF"
