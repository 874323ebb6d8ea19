"""lm-evaluation-harness, unchanged, against Tandem: its ``local-completions`` model
(``echo`` with ``logprobs``, token ids in, as ``tokenized_requests`` sends them) scores
every choice of every item of a multiple-choice task kept in this repository as its
``hf`` model does on the same weights in float32, within 1e-4, so the accuracy is the
same. The command is the one docs/evaluation.md gives."""

from __future__ import annotations

import glob
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.stack import TandemStack
from tests.tools import ensure_lm_eval

TASK_DIR = Path(__file__).parent.parent / "data" / "lm_eval"
TOLERANCE = 1e-4


def run_lm_eval(binary: str, model: str, model_args: str, out: Path) -> dict[int, Any]:
    """One ``lm_eval`` run of the task; its samples by document id."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    argv = [binary, "--model", model, "--model_args", model_args, "--tasks", "tandem_mc"]
    argv += ["--include_path", ".", "--log_samples", "--output_path", str(out)]
    done = subprocess.run(argv, cwd=TASK_DIR, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    (samples,) = glob.glob(str(out / "*" / "samples_tandem_mc_*.jsonl"))
    with open(samples) as f:
        return {doc["doc_id"]: doc for doc in map(json.loads, f)}


@pytest.mark.slow
def test_local_completions_scores_each_choice_as_the_hf_model(
    server: TandemStack, smollm2_dir: Path, tmp_path: Path
) -> None:
    binary = ensure_lm_eval()
    ours = run_lm_eval(
        binary,
        "local-completions",
        f"model=smollm2-135m-instruct,base_url={server.url}/v1/completions,"
        f"tokenizer={smollm2_dir},tokenized_requests=True,num_concurrent=1,max_retries=1",
        tmp_path / "tandem",
    )
    theirs = run_lm_eval(binary, "hf", f"pretrained={smollm2_dir},dtype=float32", tmp_path / "hf")
    assert len(ours) == len(theirs) >= 50
    for doc_id, expected in theirs.items():
        got = ours[doc_id]["filtered_resps"]
        assert len(got) == len(expected["filtered_resps"]) >= 2
        for (ll, _), (ref, _) in zip(got, expected["filtered_resps"], strict=True):
            assert abs(float(ll) - float(ref)) < TOLERANCE, (doc_id, ll, ref)
        assert ours[doc_id]["acc"] == expected["acc"], doc_id
