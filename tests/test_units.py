"""Memory sizes as users write them (docs/design.md section 9)."""

from __future__ import annotations

import pytest

from xengine.units import MemorySpecError, format_bytes, parse_memory


@pytest.mark.parametrize(
    "text, n_bytes",
    [
        ("2GB", 2 * 10**9),
        ("512MiB", 2**29),
        ("1KB", 1000),
        ("1KiB", 1024),
        ("3GiB", 3 * 2**30),
        ("1.5MB", 1_500_000),
        ("2gb", 2 * 10**9),
        (" 64 MiB ", 64 * 2**20),
        ("1500000", 1_500_000),
        ("1500000B", 1_500_000),
        ("1.5e9", 1_500_000_000),
        (4096, 4096),
    ],
)
def test_absolute_sizes(text, n_bytes):
    spec = parse_memory(text)
    assert spec.bytes == n_bytes
    assert spec.fraction is None
    assert spec.resolve_bytes(keep_all_peak_bytes=10**12) == n_bytes


def test_percent_is_a_fraction_of_the_keep_all_peak():
    spec = parse_memory("60%")
    assert spec.bytes is None
    assert spec.fraction == pytest.approx(0.6)
    assert spec.resolve_bytes(keep_all_peak_bytes=1000) == 600
    assert parse_memory("150%").resolve_bytes(1000) == 1500


@pytest.mark.parametrize(
    "text, words",
    [
        ("2XB", ["2XB", "unit"]),
        ("-1GB", ["-1GB", "negative"]),
        ("GB", ["GB"]),
        ("", []),
        ("0%", ["0%"]),
        ("1e400%", []),
        (-5, ["negative"]),
        (True, ["not a size"]),
        ("2 GB 3", []),
    ],
)
def test_errors_say_what_is_wrong(text, words):
    with pytest.raises(MemorySpecError) as ei:
        parse_memory(text)
    msg = str(ei.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg


def test_memory_spec_error_is_a_value_error():
    # run.py turns ValueErrors from config validation into exit code 2
    assert issubclass(MemorySpecError, ValueError)


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(2**29) == "512.0 MiB"
    assert format_bytes(3 * 2**30) == "3.0 GiB"
