"""Speculative decoding on the engine side: which tokens to propose for a decoding
request, when proposing pays, and what the verifications accepted.

The scheduler asks ``drafts_for`` while it plans a request's decode; the proposed tokens
ride in the step after the request's real token, the workers verify them in that one
forward (``worker/draft_verifier.py``) and answer how many they accepted, which comes
back through ``accepted``. N-gram proposals are read from the request's own tokens, so
nothing here touches a model.

Speculation never makes a request slower on purpose: a request whose drafts keep being
rejected stops drafting for a while (doubling each time, up to ``_MAX_BACKOFF`` steps),
and a step that decodes more than ``disable_by_batch_size`` requests drafts nothing,
since its forward is bound by compute rather than by reading the weights.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from common.speculative_config import SpeculativeConfig
from engine_core.request import Request

_ITEM = array("i").itemsize
# Below this share of drafted tokens accepted (smoothed), a request backs off.
_MIN_ACCEPTANCE = 0.3
_MAX_BACKOFF = 64
# With async scheduling, a step planned without waiting for the last one cannot draft;
# after this many such steps without drafts, one waits and looks.
_PROBE_EVERY = 4


class NgramProposer:
    """The tokens that followed the latest earlier occurrence of the last n tokens (n
    from ``max_n`` down to ``min_n``), vLLM's prompt lookup."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: Sequence[int], max_drafts: int) -> list[int]:
        if max_drafts <= 0 or len(token_ids) < self.min_n + 1:
            return []
        # Searched as bytes (C's memory search, not a Python loop): 4 bytes per token,
        # a hit counts only on a token boundary.
        data = array("i", token_ids).tobytes()
        for n in range(min(self.max_n, len(token_ids) - 1), self.min_n - 1, -1):
            suffix = data[-n * _ITEM :]
            end = len(data) - _ITEM  # an occurrence must leave a token after it
            while True:
                at = data.rfind(suffix, 0, end)
                if at < 0:
                    break
                if at % _ITEM == 0:
                    start = at // _ITEM + n
                    return list(token_ids[start : start + max_drafts])
                end = at + n * _ITEM - 1  # an unaligned hit: look before it
        return []


@dataclass
class DraftRecord:
    """One request's record: smoothed acceptance and how long it waits to draft again."""

    acceptance: float = 1.0
    backoff: int = 0  # steps to skip now
    next_backoff: int = 1

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        self.acceptance = 0.5 * self.acceptance + 0.5 * (num_accepted / num_drafts)
        if self.acceptance < _MIN_ACCEPTANCE:
            self.backoff = self.next_backoff
            self.next_backoff = min(2 * self.next_backoff, _MAX_BACKOFF)
            self.acceptance = _MIN_ACCEPTANCE  # tried afresh after the wait
        elif num_accepted == num_drafts:
            self.next_backoff = 1

    def ready(self) -> bool:
        """Whether the request drafts in this step; a step it waits counts off its wait."""
        if self.backoff > 0:
            self.backoff -= 1
            return False
        return True


@dataclass
class SpecDecodeCounters:
    """Cumulative, as vLLM's spec_decode_* metrics count them."""

    num_drafts: int = 0  # verifications (one request, one step)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def add(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_drafts:
            self.accepted_per_pos += [0] * (num_drafts - len(self.accepted_per_pos))
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1


class Speculation:
    """Drafts by prompt lookup, within ``config``'s limits."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.counters = SpecDecodeCounters()
        self._records: dict[str, DraftRecord] = {}
        self._drafted_last = False
        self._ahead_since_probe = _PROBE_EVERY  # the first step looks

    def step_allows(self, num_decoding: int) -> bool:
        """Whether a step decoding ``num_decoding`` requests carries drafts at all."""
        return num_decoding <= self.config.disable_by_batch_size

    def drafts_for(self, request: Request, room: int) -> list[int]:
        """Tokens to verify after the request's next one; ``room``: the most it may take
        (the step's token budget left, and what ``max_tokens`` and the context allow)."""
        params = request.sampling_params
        if params.structured is not None or params.logprobs is not None:
            return []  # their grammar state and logprobs advance one token a step
        record = self._records.setdefault(request.request_id, DraftRecord())
        if not record.ready():
            return []
        room = min(room, self.config.num_speculative_tokens)
        return self.proposer.propose(request.token_ids, room)

    def wants_sync(self, num_running: int) -> bool:
        """Whether the next step should wait for the one in flight rather than be planned
        ahead of it: a request can draft only once its last token is known. True after a
        step that drafted, and every ``_PROBE_EVERY`` steps planned ahead, to look again."""
        if not self.step_allows(num_running):
            return False
        return self._drafted_last or self._ahead_since_probe >= _PROBE_EVERY

    def planned(self, ahead: bool, drafted: bool) -> None:
        """A step was planned (``ahead``: while another was in flight)."""
        if ahead:
            self._ahead_since_probe += 1
        else:
            self._drafted_last = drafted
            self._ahead_since_probe = 0

    def accepted(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        self.counters.add(num_drafts, num_accepted)
        record = self._records.get(request_id)
        if record is not None:
            record.observe(num_drafts, num_accepted)

    def forget(self, request_id: str) -> None:
        self._records.pop(request_id, None)


class NoSpeculation(Speculation):
    """Speculation off: no drafts, counters at zero."""

    def __init__(self) -> None:
        super().__init__(SpeculativeConfig())

    def step_allows(self, num_decoding: int) -> bool:
        return False

    def wants_sync(self, num_running: int) -> bool:
        return False


def make_speculation(config: SpeculativeConfig) -> Speculation:
    return Speculation(config) if config.enabled else NoSpeculation()
