"""bench.step_profile's attribution: each op's self time goes to its nearest labelled
range, else to its kind; time in no op is Python and dispatch; the shares sum to one."""

from __future__ import annotations

import time

import pytest
import torch
from torch.profiler import record_function

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
