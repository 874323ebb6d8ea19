"""bench.step_profile's attribution: each op's self time goes to its nearest labelled
range, else to its kind; time in no op is Python and dispatch; the shares sum to one. The
fused step's phases as rates: the projections' FLOPs and weight bytes, attention's KV bytes,
each a second and against the machine's."""

from __future__ import annotations

import time

import pytest
import torch
from torch.profiler import record_function

from bench.floor import Machine, ModelCost
from bench.fused_phases import phase_rates
from bench.step_profile import PARTS, model_shares


def test_time_is_attributed_to_labels_kinds_and_python() -> None:
    a, b = torch.randn(256, 256), torch.randn(256, 256)

    def step() -> None:
        with record_function("tandem::norms"):
            (a * b).sum()  # an elementwise op, but inside the norms label
        torch.mm(a, b)  # a matmul, unlabelled
        time.sleep(0.05)  # in no op at all

    shares = model_shares(step, steps=3)
    assert set(shares) == set(PARTS)
    assert sum(shares.values()) == pytest.approx(1.0, abs=1e-6)
    assert shares["norms"] > 0 and shares["matmul"] > 0
    assert shares["python+dispatch"] > 0.3  # the sleep
    assert shares["attention"] == shares["sampling"] == 0


def test_phase_rates_are_work_over_phase_time() -> None:
    row = {
        "batch": 32,
        # 2 x 32 rows x 1e8 weights in 6.4 ms: 1 TFLOP/s; 2e8 bytes of weights: 31.25 GB/s
        # 2,000 positions x 1,000 bytes of KV in 0.1 ms: 20 GB/s
        "fused_phases": {
            "phases_ms": {"projections": 6.4, "attention": 0.1},
            "positions_per_step": 2000.0,
        },
    }
    cost = ModelCost(0, 0, kv_bytes_per_position=1000, attention_flops_per_position=0)
    line = phase_rates(row, 10**8, cost, Machine(read_gb_s=80.0, matmul_tflops=2.0), 2)
    assert "contexts ~62" in line
    assert "projections 1.00 TFLOP/s (50% of the matmul rate)" in line
    assert "weights read at 31.2 GB/s" in line
    assert "read 2 MB of KV at 20.0 GB/s (25% of the read bandwidth)" in line
