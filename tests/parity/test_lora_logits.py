"""LoRA adapters against transformers + PEFT, every family (tiny random checkpoints,
float32): random adapters made here by PEFT (all seven projections; q and v only;
rank-stabilized), then one batch whose rows run three adapters and the base model at
once, through a prefill, a step of prefill and decodes, and a decode-only step; each
row's logits within 1e-4 of PEFT's for its adapter (or the base model's), the same
greedy tokens. The same at tensor-parallel size 2 (two gloo rank processes)."""

from __future__ import annotations

import copy
import multiprocessing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import PreTrainedModel

from common.ipc import free_tcp_port
from common.lora import LORA_TARGETS
from common.messages import LoRARequest
from tests.parity.families import FAMILIES, build
from worker.attention import AttentionMetadata, build_metadata
from worker.lora import LoRABatch, LoRACache, LoRAWeights, attach_lora, load_lora_weights
from worker.models.decoder import DecoderLM
from worker.models.loader import load_model
from worker.ops import TorchOps
from worker.parallel import TensorParallel, destroy_group, init_group

BLOCK = 4
TOL = 1e-4
FAST_FAMILY = "qwen2"  # q/k/v biases beside the adapters' deltas; the rest run with -m slow
ADAPTERS: dict[str, dict[str, Any]] = {
    "all": {"r": 8, "lora_alpha": 16, "target_modules": list(LORA_TARGETS)},
    "qv": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    "rs": {
        "r": 16,
        "lora_alpha": 8,
        "use_rslora": True,
        "target_modules": ["k_proj", "o_proj", "gate_proj", "down_proj"],
    },
}
# The batch's sequences: (adapter or None for the base model, prompt); "all" twice.
SEQS: list[tuple[str | None, list[int]]] = [
    ("all", [5, 17, 99, 3, 42, 8, 64]),
    (None, [120, 4, 56, 9, 31]),
    ("qv", [7, 7, 21, 88, 2, 13, 101, 40, 6]),
    ("all", [64, 1, 77, 23, 11, 90]),
    ("rs", [15, 33, 2, 70, 9, 44]),
]


@dataclass
class Family:
    checkpoint: Path
    base: PreTrainedModel
    adapters: dict[str, tuple[LoRARequest, PeftModel]]  # by name in ADAPTERS

    @property
    def requests(self) -> dict[str, LoRARequest]:
        return {name: request for name, (request, _) in self.adapters.items()}


def make_family(name: str, path: Path) -> Family:
    """The family's checkpoint in ``path`` and each of ADAPTERS, made and saved by PEFT
    on a copy of it (get_peft_model changes the model it is given)."""
    base = build(name, path)
    adapters: dict[str, tuple[LoRARequest, PeftModel]] = {}
    for int_id, (adapter, args) in enumerate(ADAPTERS.items(), start=1):
        torch.manual_seed(int_id)
        config = LoraConfig(init_lora_weights=False, **args)  # B random, not zero
        peft_model = get_peft_model(copy.deepcopy(base), config).eval()
        peft_model.save_pretrained(str(path / f"lora-{adapter}"))
        request = LoRARequest(name=adapter, int_id=int_id, path=str(path / f"lora-{adapter}"))
        adapters[adapter] = (request, peft_model)
    return Family(path, base, adapters)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Family]:
    """Each family made once for the module, when a test first asks for it."""
    families: dict[str, Family] = {}

    def get(name: str) -> Family:
        if name not in families:
            families[name] = make_family(name, tmp_path_factory.mktemp(name))
        return families[name]

    return get


@pytest.fixture(
    scope="module",
    params=[f if f == FAST_FAMILY else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES],
)
def family(request: pytest.FixtureRequest, built: Callable[[str], Family]) -> Family:
    return built(request.param)


@pytest.fixture(scope="module")
def fast_family(built: Callable[[str], Family]) -> Family:
    return built(FAST_FAMILY)


def load_with_lora(checkpoint: Path, tp: TensorParallel | None = None) -> DecoderLM:
    model = load_model(checkpoint, torch.float32, torch.device("cpu"), TorchOps(), tp)
    assert isinstance(model, DecoderLM)
    attach_lora(model, LoRABatch())
    return model


def load_adapters(model: DecoderLM, requests: Mapping[str, LoRARequest]) -> dict[str, LoRAWeights]:
    return {name: load_lora_weights(request, model) for name, request in requests.items()}


def run_scenario(
    model: DecoderLM, adapters: Mapping[str, LoRAWeights]
) -> tuple[list[torch.Tensor], list[list[int]]]:
    """SEQS through three steps in one batch each: every prompt but the last whole and the
    last's first two tokens; the last's rest beside one greedy decode of the others; one
    greedy decode of all. Returns each sequence's logits, row per computed position, and
    its final tokens."""
    batch = model.lora_batch
    assert isinstance(batch, LoRABatch)
    caches = [torch.zeros(model.kv_cache_shape(64, BLOCK)) for _ in range(model.num_layers)]
    seqs = [list(tokens) for _, tokens in SEQS]
    blocks = [[13 * i + j for j in range(4)] for i in range(len(seqs))]  # 4 blocks of 4 each
    logits: list[list[torch.Tensor]] = [[] for _ in seqs]

    def step(spans: list[tuple[int, int]]) -> None:  # (start, length) per sequence
        ids: list[int] = []
        positions: list[int] = []
        rows: dict[str, list[int]] = {}
        for i, (start, length) in enumerate(spans):
            adapter = SEQS[i][0]
            if adapter is not None:
                rows.setdefault(adapter, []).extend(range(len(ids), len(ids) + length))
            ids += seqs[i][start : start + length]
            positions += range(start, start + length)
        meta = build_metadata(
            blocks, [s for s, _ in spans], [n for _, n in spans], BLOCK, torch.device("cpu")
        )
        batch.set([(adapters[name], torch.tensor(r)) for name, r in rows.items()])
        try:
            with torch.inference_mode():
                hidden = model(torch.tensor(ids), torch.tensor(positions), caches, meta)
                out = model.compute_logits(hidden)
        finally:
            batch.clear()
        for i, part in enumerate(out.split([n for _, n in spans])):
            logits[i].append(part)

    def greedy(indices: range) -> None:
        for i in indices:
            seqs[i].append(int(logits[i][-1][-1].argmax()))

    *early, last = seqs
    step([(0, len(s)) for s in early] + [(0, 2)])
    greedy(range(len(early)))
    step([(len(s) - 1, 1) for s in early] + [(2, len(last) - 2)])
    greedy(range(len(seqs)))
    step([(len(s) - 1, 1) for s in seqs])
    return [torch.cat(rows) for rows in logits], seqs


def assert_matches_peft(family: Family, logits: list[torch.Tensor], seqs: list[list[int]]) -> None:
    """Each sequence's rows against transformers (with PEFT for its adapter) on its final
    tokens: within TOL, and the same argmax, so the same greedy tokens."""
    for (adapter, _), ours, tokens in zip(SEQS, logits, seqs, strict=True):
        reference = family.base if adapter is None else family.adapters[adapter][1]
        with torch.no_grad():
            ref = reference(torch.tensor([tokens])).logits[0][: ours.shape[0]]
        assert ours.shape == ref.shape
        diff = (ours - ref).abs().max()
        assert diff < TOL, f"{adapter or 'base'}: max abs diff {diff:.2e}"
        assert torch.equal(ours.argmax(-1), ref.argmax(-1)), adapter or "base"


def test_rows_of_three_adapters_and_the_base_in_one_batch(family: Family) -> None:
    model = load_with_lora(family.checkpoint)
    logits, seqs = run_scenario(model, load_adapters(model, family.requests))
    assert_matches_peft(family, logits, seqs)
    # The adapters change the logits: the base model's would fail the check above.
    with torch.no_grad():
        base = family.base(torch.tensor([seqs[0]])).logits[0][: logits[0].shape[0]]
    assert (logits[0] - base).abs().max() > 1e-2


def test_the_cache_drops_the_least_recently_used(fast_family: Family) -> None:
    model = load_with_lora(fast_family.checkpoint)
    a, b, c = (fast_family.adapters[name][0] for name in ("all", "qv", "rs"))
    cache = LoRACache(model, capacity=2)
    first = cache.get(a)
    cache.get(b)
    assert cache.get(a) is first and cache.num_loads == 2  # a hit, now the most recent
    cache.get(c)  # b out
    assert a.int_id in cache and c.int_id in cache and b.int_id not in cache
    cache.get(b)  # loaded again; a out
    assert cache.num_loads == 4 and len(cache) == 2 and a.int_id not in cache


class RecordingFusedDecode:
    """Takes every step and records that it ran: a stand-in for ``DecodeStack``."""

    def __init__(self, hidden_size: int) -> None:
        self.hidden_size, self.calls = hidden_size, 0

    def takes(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        return True

    def __call__(
        self,
        input_ids: torch.Tensor,
        rope: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        self.calls += 1
        return torch.zeros(input_ids.shape[0], self.hidden_size)


def test_the_fused_decode_path_is_left_while_adapter_rows_run(fast_family: Family) -> None:
    model = load_with_lora(fast_family.checkpoint)
    batch = model.lora_batch
    assert isinstance(batch, LoRABatch)
    fused = RecordingFusedDecode(model.args.hidden_size)
    model.fused_decode = fused
    caches = [torch.zeros(model.kv_cache_shape(8, BLOCK)) for _ in range(model.num_layers)]
    meta = build_metadata([[0, 1]], [0], [3], BLOCK, torch.device("cpu"))
    weights = load_lora_weights(fast_family.adapters["qv"][0], model)
    ids, positions = torch.tensor([5, 6, 7]), torch.tensor([0, 1, 2])
    with torch.inference_mode():
        batch.set([(weights, torch.tensor([1, 2]))])
        assert model(ids, positions, caches, meta).abs().max() > 0  # the layers ran
        assert fused.calls == 0
        batch.clear()
        model(ids, positions, caches, meta)
        assert fused.calls == 1


# ------------------------------------------------------------ tensor parallel size 2


def rank_main(
    rank: int, address: str, jobs: dict[str, tuple[Path, dict[str, LoRARequest]]], out: str
) -> None:
    """One rank of a gloo group of two, through every family in turn; rank 0 saves each
    family's logits and sequences, or what went wrong in it."""
    torch.set_num_threads(1)
    tp = init_group(rank, 2, address, torch.device("cpu"))
    results: dict[str, Any] = {}
    try:
        for name, (checkpoint, requests) in jobs.items():
            try:
                model = load_with_lora(checkpoint, tp)
                results[name] = run_scenario(model, load_adapters(model, requests))
            except Exception as e:  # reported by that family's test
                results[name] = repr(e)
        if rank == 0:
            torch.save(results, out)
    finally:
        destroy_group(tp)


@pytest.fixture(scope="module")
def sharded(
    built: Callable[[str], Family], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """Every family's scenario at tensor-parallel size 2, from one group of two ranks
    (each spawn costs seconds)."""
    jobs = {name: (built(name).checkpoint, built(name).requests) for name in sorted(FAMILIES)}
    out = tmp_path_factory.mktemp("tp") / "results.pt"
    address = f"tcp://127.0.0.1:{free_tcp_port()}"
    spawn = multiprocessing.get_context("spawn")
    ranks = [spawn.Process(target=rank_main, args=(r, address, jobs, str(out))) for r in (0, 1)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=600)
    assert [p.exitcode for p in ranks] == [0, 0]
    results: dict[str, Any] = torch.load(out)
    return results


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_two_ranks_match_peft(
    built: Callable[[str], Family], sharded: dict[str, Any], name: str
) -> None:
    result = sharded[name]
    assert not isinstance(result, str), f"the two ranks failed: {result}"
    assert_matches_peft(built(name), *result)
