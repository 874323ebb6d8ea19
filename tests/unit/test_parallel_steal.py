"""tandem::parallel_steal (worker/csrc/parallel.h), which splits bf16_gemm's, the GGUF
GEMM's and bf16 decode attention's tasks between the step's threads: every task runs
exactly once whatever the thread count, and a thread done with its own share takes the
others' last tasks."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from worker.native import load_native_kernels

kernels = load_native_kernels()


@pytest.fixture
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("num_threads", [1, 2, 3, 4])
@pytest.mark.parametrize("count", [1, 2, 3, 7, 64, 1000])
def test_every_task_runs_once(threads: None, num_threads: int, count: int) -> None:
    torch.set_num_threads(num_threads)
    # Uneven costs, so shares finish at different times and the threads steal.
    costs = torch.tensor([(7 * i) % 5 * 20 for i in range(count)], dtype=torch.long)
    trace = kernels.parallel_steal_trace(costs)
    assert trace[:, 0].tolist() == [1] * count
    assert set(trace[:, 1].tolist()) <= set(range(num_threads))


def test_no_tasks(threads: None) -> None:
    assert kernels.parallel_steal_trace(torch.zeros(0, dtype=torch.long)).shape == (0, 2)


def test_a_thread_done_with_its_share_takes_the_others_last_tasks(threads: None) -> None:
    torch.set_num_threads(2)
    # The first share's 8 tasks take 3 ms each, the second share's none: thread 1 finishes
    # its own at once and takes the first share's tasks from its end, while thread 0 is on
    # its first one (it would have to lose its core for ~20 ms for this not to hold).
    costs = torch.tensor([3000] * 8 + [0] * 8, dtype=torch.long)
    trace = kernels.parallel_steal_trace(costs)
    assert trace[:, 0].tolist() == [1] * 16
    ran_by = trace[:, 1].tolist()
    if set(ran_by) == {0}:
        pytest.fail("one thread ran every task: was the second never started?")
    assert ran_by[8:] == [1] * 8  # its own share, front to back, before any theft
    stolen = [i for i in range(8) if ran_by[i] == 1]
    assert stolen, ran_by
    # Taken from the back: the stolen tasks are the share's last ones, contiguous.
    assert stolen == list(range(8 - len(stolen), 8)), ran_by
    assert ran_by[0] == 0  # the owner started at the front


def test_costs_must_be_int64() -> None:
    with pytest.raises(RuntimeError, match="costs_us"):
        kernels.parallel_steal_trace(torch.zeros(3, dtype=torch.float32))
