from __future__ import annotations

import pytest

from bench.harness import host_line, host_rates, percentile


def test_percentile_interpolates() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 95) == pytest.approx(3.85)
    assert percentile([7.0], 99) == 7.0


def test_percentile_of_nothing_is_an_error() -> None:
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)


def test_host_rates_measure_this_host_in_a_child_process() -> None:
    """The rates a benchmark records before and after its run: real measurements (a
    copy-free read of 256 MiB, a 1024^3 bf16 matmul), and torch stays out of this process
    (the benchmark's own, which must stay light beside the servers it measures)."""
    import sys

    had_torch = "torch" in sys.modules
    rates = host_rates()
    assert set(rates) == {"read_gb_s", "bf16_matmul_tflops"}
    assert 1 < rates["read_gb_s"] < 10_000  # GB/s: a host's memory, not a cache or a clock
    assert 0.001 < rates["bf16_matmul_tflops"] < 1_000
    assert ("torch" in sys.modules) == had_torch
    line = host_line(rates, {"read_gb_s": 1.25, "bf16_matmul_tflops": 0.5})
    assert f"memory read {rates['read_gb_s']:.1f} -> 1.2 GB/s" in line
    assert "-> 0.50 TFLOP/s" in line
