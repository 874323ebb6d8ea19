"""The worker's per-step work: keep the persistent batch state, build input tensors,
run one forward over every scheduled token, sample.

State handed over by the engine: a ``NewRequestData`` gives a request's tokens and
blocks once; afterwards ``CachedRequestData`` diffs extend its blocks. Tokens this
runner samples are appended to its own copy of the request, so the engine never sends
them back.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from common.config import AttentionBackend, CacheConfig
from common.messages import (
    CachedRequestData,
    KVTransferResult,
    LoRARequest,
    ModelInfo,
    ModelRunnerOutput,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)
from common.model_files import read_hf_config
from worker.attention import build_metadata
from worker.draft_verifier import SampleRow, num_accepted, rows_for
from worker.kv_memory import SharedCaches, local_caches
from worker.kv_transport import KVTransport, NoTransport
from worker.lora_steps import NoAdapters, StepAdapters
from worker.models.loader import load_model
from worker.models.quantizers import WeightQuantizer
from worker.ops import NativeOps, pick_ops
from worker.parallel import TensorParallel
from worker.prompt_logprobs import PromptSpan, compute_prompt_logprobs, prompt_span
from worker.sampler import SamplingBatch, sample
from worker.structured import GrammarMatcher, StructuredOutputs

logger = logging.getLogger(__name__)


@dataclass
class RequestState:
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # A seeded request's generators, one per row it samples in a step (several when it
    # verifies drafts); [None] when unseeded.
    generators: list[torch.Generator | None]
    grammar: GrammarMatcher | None = None  # structured outputs: where the output stands
    lora: LoRARequest | None = None  # the adapter its rows run with


def read_model_info(model_dir: Path, max_model_len: int | None) -> ModelInfo:
    """Context length, vocabulary and EOS ids from config.json / generation_config.json."""
    config = read_hf_config(model_dir)
    eos: object = config.get("eos_token_id")
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        with open(gen_path) as f:
            eos = json.load(f).get("eos_token_id", eos)
    eos_ids = (
        [int(e) for e in eos] if isinstance(eos, list) else ([] if eos is None else [int(str(eos))])
    )
    model_len = int(config.get("max_position_embeddings", 2048))
    if max_model_len is not None:
        if max_model_len > model_len:
            raise ValueError(
                f"--max-model-len {max_model_len} exceeds the model's context of {model_len}"
            )
        model_len = max_model_len
    return ModelInfo(
        max_model_len=model_len, vocab_size=int(config["vocab_size"]), eos_token_ids=eos_ids
    )


class ModelRunner:
    def __init__(
        self,
        model_dir: Path,
        dtype: torch.dtype,
        device: torch.device,
        cache: CacheConfig,
        max_model_len: int | None,
        attention_backend: AttentionBackend = "auto",
        kv_segment: str | None = None,
        tp: TensorParallel | None = None,
        quantizer: WeightQuantizer | None = None,
        lora_capacity: int = 0,
    ) -> None:
        """``kv_segment``: map the KV caches from this shared-memory segment (split pools
        with ``--kv-transfer shm``) instead of allocating them here. ``tp``: this rank's
        place in its pool's tensor-parallel group (it holds and caches its shard only).
        ``quantizer``: how to keep the projection weights (``--quantization``).
        ``lora_capacity``: LoRA adapters kept loaded (``--max-cpu-loras``); 0: no LoRA."""
        self.device = device
        self.tp = tp or TensorParallel()
        self.ops = pick_ops(attention_backend, device)
        self.block_size = cache.block_size
        self.model = load_model(model_dir, dtype, device, self.ops, self.tp, quantizer)
        self.model_info = read_model_info(model_dir, max_model_len)
        self.model_info.num_layers = self.model.num_layers
        kernels = self.ops.kernels if isinstance(self.ops, NativeOps) else None
        self.lora = (
            StepAdapters(self.model, lora_capacity, kernels) if lora_capacity else NoAdapters()
        )
        self.model_info.lora_module_shapes = self.lora.module_shapes
        one_block = math.prod(self.model.kv_cache_shape(1, self.block_size))
        self.bytes_per_block = one_block * self.model.num_layers * dtype.itemsize
        self.num_kv_blocks = cache.num_kv_blocks or self._blocks_for_memory(cache.kv_cache_gb)
        layer_shape = self.model.kv_cache_shape(self.num_kv_blocks, self.block_size)
        self.shared: SharedCaches | None = None
        if kv_segment is not None:
            if device.type != "cpu":
                raise ValueError(
                    "--kv-transfer shm maps KV in host memory: CPU workers only "
                    "(GPU workers hand KV off with --kv-transfer tcp)"
                )
            self.shared = SharedCaches(kv_segment, layer_shape, self.model.num_layers, dtype)
            self.kv_caches = self.shared.caches
        else:
            self.kv_caches = local_caches(layer_shape, self.model.num_layers, dtype, device)
        self.requests: dict[str, RequestState] = {}
        self.kv_transport: KVTransport = NoTransport()
        self.structured = StructuredOutputs(
            model_dir, self.model_info.vocab_size, self.model_info.eos_token_ids
        )
        logger.info(
            "KV cache: %d blocks of %d tokens (%s)", self.num_kv_blocks, self.block_size, dtype
        )

    def _blocks_for_memory(self, gib: float) -> int:
        blocks = int(gib * (1 << 30)) // self.bytes_per_block
        if blocks < 1:
            raise ValueError(
                f"--kv-cache-gb {gib} holds no KV block ({self.bytes_per_block} bytes each)"
            )
        return blocks

    def warm_up(self) -> None:
        """One forward through every code path (prefill and decode) before serving."""
        params = SamplingParams(max_tokens=2, temperature=1.0, top_k=5, top_p=0.9, seed=0)
        prompt_len = max(1, min(4, self.num_kv_blocks * self.block_size - 1))
        blocks = list(range(min(self.num_kv_blocks, -(-(prompt_len + 1) // self.block_size))))
        warm = NewRequestData("warmup", [0] * prompt_len, params, blocks, 0)
        self.execute(SchedulerOutput(-2, [warm], [], {"warmup": prompt_len}, []))
        if len(blocks) * self.block_size > prompt_len:
            decode = CachedRequestData("warmup", [], prompt_len)
            # Ranks > 0 did not sample: any token keeps every rank's shapes equal.
            step = SchedulerOutput(-1, [], [decode], {"warmup": 1}, [], prev_sampled={"warmup": 0})
            self.execute(step)
        self.requests.clear()

    def attach_transport(self, transport: KVTransport) -> None:
        """Split pools: this worker's end of the KV hand-off (``kv_wiring.py``)."""
        self.kv_transport = transport

    def close(self) -> None:
        """Stop the KV transfer threads (their sockets close with them)."""
        self.kv_transport.close()

    def transfer_results(self) -> list[KVTransferResult]:
        """Transfers that ended on this side since the last call."""
        return self.kv_transport.results()

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        copied = self.kv_transport.apply(step, self.kv_caches)
        output = self._execute(step)
        output.kv_copied = copied
        output.kv_results = self.transfer_results()
        return output

    def _execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        if self.tp.rank > 0 and not self.tp.broadcasts_samples:
            # Rank 0 sampled these last step; this rank did not.
            for request_id, token in step.prev_sampled.items():
                state = self.requests.get(request_id)
                if state is not None:
                    state.token_ids.append(token)
        self._update_states(step)
        input_ids: list[int] = []
        positions: list[int] = []
        block_tables: list[list[int]] = []
        starts: list[int] = []
        lengths: list[int] = []
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        spans: list[PromptSpan] = []
        adapter_rows: list[tuple[LoRARequest | None, int, int]] = []
        for request_id, num_tokens in step.num_scheduled_tokens.items():
            state = self.requests[request_id]
            adapter_rows.append((state.lora, len(input_ids), num_tokens))
            drafts = step.draft_token_ids.get(request_id, [])
            start = state.num_computed_tokens
            end = start + num_tokens - len(drafts)  # the drafts follow its real tokens
            span = prompt_span(
                request_id,
                state.token_ids,
                state.num_prompt_tokens,
                start,
                end,
                len(input_ids),
                state.sampling_params.prompt_logprobs,
            )
            if span is not None:
                spans.append(span)
            input_ids.extend(state.token_ids[start:end])
            input_ids.extend(drafts)
            positions.extend(range(start, start + num_tokens))
            block_tables.append(state.block_ids)
            starts.append(start)
            lengths.append(num_tokens)
            if end == len(state.token_ids):  # caught up: the next token is due
                sample_rows.extend(range(len(input_ids) - 1 - len(drafts), len(input_ids)))
                sample_ids.append(request_id)
        if not input_ids:
            return ModelRunnerOutput(step.step_id, [], [])
        meta = build_metadata(block_tables, starts, lengths, self.block_size, self.device)
        with self.lora.rows(adapter_rows, self.device):
            hidden = self.model(
                torch.tensor(input_ids, dtype=torch.long, device=self.device),
                torch.tensor(positions, dtype=torch.long, device=self.device),
                self.kv_caches,
                meta,
            )
        prompt_lps = compute_prompt_logprobs(hidden, spans, self.model.compute_logits)
        if self.tp.rank > 0:
            prompt_lps = {}  # rank 0 reports them
        if not sample_rows:
            return ModelRunnerOutput(step.step_id, [], [], prompt_logprobs=prompt_lps)
        if len(sample_rows) < len(input_ids):  # rows that do not sample: prefill chunks
            rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
            hidden = hidden.index_select(0, rows)
        logits = self.model.compute_logits(hidden)
        if self.tp.rank > 0:  # its logits shard went into rank 0's gather; rank 0 samples
            if self.tp.broadcasts_samples:
                shared = self.tp.share_samples([0] * len(sample_ids), self.device)
                for request_id, token in zip(sample_ids, shared, strict=True):
                    self.requests[request_id].token_ids.append(token)
            return ModelRunnerOutput(step.step_id, [], [])
        sample_at = self._sample_rows(sample_ids, step.draft_token_ids)
        states = [self.requests[row.request_id] for row in sample_at]
        batch = SamplingBatch.build(
            [s.sampling_params for s in states],
            [row.generator for row in sample_at],
            self.device,
            token_ids=[row.token_ids for row in sample_at],
            num_prompt_tokens=[s.num_prompt_tokens for s in states],
            vocab_size=logits.shape[-1],
            eos_token_ids=self.model_info.eos_token_ids,
            constraint=self.structured.step([s.grammar for s in states]),
        )
        result = sample(logits, batch, self.ops)
        if self.tp.broadcasts_samples:
            self.tp.share_samples(result.token_ids, self.device)
        output = ModelRunnerOutput(step.step_id, sample_ids, [], prompt_logprobs=prompt_lps)
        row = 0
        for request_id in sample_ids:
            state, drafts = self.requests[request_id], step.draft_token_ids.get(request_id, [])
            samples = result.token_ids[row : row + len(drafts) + 1]
            accepted = num_accepted(samples, drafts)
            if drafts:
                output.num_accepted_drafts[request_id] = accepted
            state.token_ids.extend(samples[: accepted + 1])  # the drafts it kept, its own
            output.sampled_token_ids.append(samples[accepted])
            if result.logprobs:
                output.logprobs.append(result.logprobs[row + accepted])
            if state.grammar is not None:  # never drafts: one token
                state.grammar.advance(samples[0])
            row += len(drafts) + 1
        return output

    def _sample_rows(self, sample_ids: list[str], drafts: dict[str, list[int]]) -> list[SampleRow]:
        """One row per request, or per draft and one more (``draft_verifier.py``); seeded
        rows seeded by (seed, position), so a sample depends on neither the batch, nor a
        preemption and recompute, nor speculation."""
        rows: list[SampleRow] = []
        for request_id in sample_ids:
            state = self.requests[request_id]
            rows += rows_for(
                request_id, state.token_ids, drafts.get(request_id, []), state.generators
            )
        for row in rows:
            seed = self.requests[row.request_id].sampling_params.seed
            if row.generator is not None and seed is not None:
                position = len(row.token_ids)
                row.generator.manual_seed((seed * 1_000_003 + position) % (1 << 63))
        return rows

    def _update_states(self, step: SchedulerOutput) -> None:
        for request_id in step.finished_request_ids:
            self.requests.pop(request_id, None)
        for new in step.new_requests:
            params = new.sampling_params
            generator = None if params.seed is None else torch.Generator(device=self.device)
            num_prompt = new.num_prompt_tokens or len(new.token_ids)
            grammar = None
            if params.structured is not None:
                # After a preemption the tokens generated so far are replayed.
                grammar = self.structured.matcher(
                    params.structured, new.request_id, new.token_ids[num_prompt:]
                )
            self.requests[new.request_id] = RequestState(
                token_ids=list(new.token_ids),
                num_prompt_tokens=num_prompt,
                sampling_params=params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                generators=[generator],
                grammar=grammar,
                lora=new.lora,
            )
        for cached in step.cached_requests:
            state = self.requests[cached.request_id]
            if cached.num_kept_blocks is not None:  # a speculative step gave some back
                del state.block_ids[cached.num_kept_blocks :]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
