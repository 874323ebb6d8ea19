from __future__ import annotations

import faulthandler
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.model_files import resolve_model_dir
from tests.stack import TandemStack


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` need a CUDA device: skipped, saying so, where there is none."""
    import torch

    if torch.cuda.is_available():
        return
    no_gpu = pytest.mark.skip(reason="needs a CUDA device (run where one is; see docs)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(no_gpu)


# A thread or a logging handler that outlives the tests can keep the interpreter from
# exiting (a handler stuck in emit once held logging's lock at shutdown: the run printed
# its summary and CI waited out its whole limit). Past this many seconds after the run,
# every thread's stack goes to stderr and the process exits with 1.
EXIT_DEADLINE_S = float(os.environ.get("TANDEM_TEST_EXIT_DEADLINE_S", "120"))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # The real stderr's descriptor: pytest's capture may stand in for sys.stderr.
    faulthandler.dump_traceback_later(EXIT_DEADLINE_S, exit=True, file=sys.__stderr__ or 2)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded default model, converted once into the cache."""
    return resolve_model_dir("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def server(smollm2_dir: Path) -> Iterator[TandemStack]:
    """One float32 stack shared by the tests that only send requests."""
    # 32 sequences of tool-call schemas and answers at once: room for all of them.
    with TandemStack("--dtype", "float32", "--max-num-seqs", "32", "--kv-cache-gb", "1") as stack:
        yield stack


@pytest.fixture(autouse=True)
def _shared_server_up(request: pytest.FixtureRequest) -> None:
    """A test of the shared stack that finds it gone fails saying why (its exit code and
    log), rather than with a bare connection error like every test after it."""
    if "server" in request.fixturenames:
        report = request.getfixturevalue("server").down_report()
        if report is not None:
            pytest.fail(f"the shared server is down: {report}", pytrace=False)
