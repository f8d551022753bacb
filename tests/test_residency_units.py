"""Sizes and durations as flags, TOML and request bodies write them, and the messages that refuse the rest
(they are what the CLI prints and what an HTTP 400 carries)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from diffusiond.daemon.residency.budget import NO_BUDGET
from diffusiond.daemon.residency.units import FOREVER, Size, format_bytes, format_duration, parse_duration, parse_size


@pytest.mark.parametrize(("text", "nbytes"), [
    ("0", 0), ("1", 1), ("2147483648", 2147483648), ("512B", 512),
    ("1K", 1000), ("1KB", 1000), ("1k", 1000), ("2M", 2_000_000), ("20G", 20 * 10**9), ("20gb", 20 * 10**9),
    ("1T", 10**12), ("1.5G", 1_500_000_000),
    ("1KiB", 1024), ("4MiB", 4 * 1024**2), ("20GiB", 20 * 1024**3), ("20 GiB", 20 * 1024**3), ("1TiB", 1024**4),
    ("0.5GiB", 512 * 1024**2), ("  8gib ", 8 * 1024**3),
])
def test_sizes_in_bytes(text: str, nbytes: int) -> None:
    assert parse_size(text) == Size(nbytes=nbytes)
    assert parse_size(text).resolve(None) == nbytes


@pytest.mark.parametrize(("text", "share"), [("0.8", 0.8), ("1.0", 1.0), (".5", 0.5), ("0.05", 0.05)])
def test_a_decimal_without_a_unit_is_a_share_of_the_device(text: str, share: float) -> None:
    size = parse_size(text)
    assert size == Size(share=share)
    assert size.resolve(80 * 10**9) == int(80 * 10**9 * share)
    assert "of the device" in str(size)


def test_toml_values_arrive_typed_and_follow_the_same_rule() -> None:
    assert parse_size(1024) == Size(nbytes=1024)
    assert parse_size(0.8) == Size(share=0.8)
    with pytest.raises(ValueError, match="boolean"):
        parse_size(True)
    with pytest.raises(ValueError, match="negative"):
        parse_size(-1)


def test_a_share_needs_the_device_total() -> None:
    with pytest.raises(ValueError, match=r"total is not known.*20GiB"):
        Size(share=0.5).resolve(None)


@pytest.mark.parametrize("text", ["", "G", "abc", "1.5", "2.0", "1e9", "-1G", "1GB2", "1 G B", "1Gi", "1PiB",
                                  "nan", "inf", "0.0", "1" * 100])
def test_bad_sizes_name_the_text_and_the_accepted_forms(text: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_size(text)
    message = str(err.value)
    assert repr(text[:64]) in message
    assert "KiB/MiB/GiB/TiB" in message and "0 < share <= 1" in message


@pytest.mark.parametrize(("text", "seconds"), [
    ("0", 0.0), ("0s", 0.0), ("30", 30.0), ("2.5", 2.5), ("30s", 30.0), ("5m", 300.0), ("1h", 3600.0),
    ("1h30m", 5400.0), ("1h30m15s", 5415.0), ("250ms", 0.25), ("1.5h", 5400.0), ("+5m", 300.0), ("100us", 1e-4),
    ("-0", 0.0), ("2.5e2", 250.0), ("1E3", 1000.0),
])
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["-1", "-5m", "-1s", -1, -0.5, "1e17", 1e17, "99999999999h"])  # api.md's forms
def test_any_negative_duration_or_one_past_a_century_is_forever(value: str | int | float) -> None:
    assert parse_duration(value) == FOREVER == math.inf


def test_numbers_from_toml_or_json_are_seconds() -> None:
    assert parse_duration(600) == 600.0
    assert parse_duration(0) == 0.0
    assert parse_duration(1.5) == 1.5
    with pytest.raises(ValueError, match="not finite"):
        parse_duration(math.inf)
    with pytest.raises(ValueError, match="boolean"):
        parse_duration(False)


@pytest.mark.parametrize("text", ["", "-", "m", "5x", "5m30", "1d", "5 m", "h1", "1h-30m", "1..5s", "1" * 100, "1e",
                                  "e5", "1e5m"])
def test_bad_durations_name_the_text_and_the_accepted_forms(text: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_duration(text)
    message = str(err.value)
    assert repr(text[:64]) in message
    assert "5m" in message and "-1" in message and "0 to leave at once" in message


def test_formatting_for_messages() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(20 * 1024**3) == "20.00 GiB"
    assert format_bytes(3 * 1024**4) == "3.00 TiB"
    # no budget is a device whose memory cannot be read or a host without --host-memory, never "no --device-memory"
    assert format_bytes(NO_BUDGET) == "unbounded"
    assert format_duration(FOREVER) == "forever"
    assert format_duration(0) == "0s"
    assert format_duration(0.25) == "250ms"
    assert format_duration(5400) == "1h30m"
    assert format_duration(300) == "5m"


@given(st.integers(min_value=0, max_value=10**6), st.sampled_from(["", "K", "M", "G", "KiB", "MiB", "GiB"]))
def test_any_whole_number_with_a_unit_parses(n: int, unit: str) -> None:
    factor = {"": 1, "K": 1000, "M": 1000**2, "G": 1000**3, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}[unit]
    assert parse_size(f"{n}{unit}").resolve(None) == n * factor


@given(st.integers(0, 99), st.integers(0, 59), st.integers(0, 59))
def test_durations_round_trip_through_their_formatting(h: int, m: int, s: int) -> None:
    seconds = h * 3600 + m * 60 + s
    assert parse_duration(format_duration(seconds)) == seconds


@given(st.text(max_size=30))
def test_any_text_parses_or_raises_value_error(text: str) -> None:
    for parse in (parse_size, parse_duration):
        try:
            parse(text)
        except ValueError:
            pass
