"""The steps a scheduler has sent that its workers have not answered yet.

One step in flight is the rule without async scheduling; with it, the next step is
planned while the last one runs. Either way a request's KV blocks may still be written
by such a step after the request ended (a client abort, an EOS found in an earlier
step's output), so its blocks are freed only once the last step holding it is done.
"""

from __future__ import annotations

from engine_core.request import Request


class StepsInFlight:
    def __init__(self) -> None:
        self._requests: dict[int, dict[str, Request]] = {}  # by step id, oldest first
        self._free_after: dict[int, list[str]] = {}  # step id -> requests to free then

    def __bool__(self) -> bool:
        return bool(self._requests)

    def add(
        self, step_id: int, num_scheduled: dict[str, int], requests: dict[str, Request]
    ) -> None:
        """Count the step's tokens as scheduled ahead, with a placeholder for each request
        the step brings to its end (the workers sample its next token)."""
        in_step = {}
        for request_id, n in num_scheduled.items():
            request = requests[request_id]
            request.num_scheduled_ahead += n
            if request.num_tokens_unscheduled == 0:
                request.num_output_placeholders += 1
            in_step[request_id] = request
        self._requests[step_id] = in_step

    def done(self, step_id: int) -> tuple[dict[str, Request], list[str]]:
        """The step's requests as they were when it was sent (a request that ended and
        came back under the same id is another object), and the ids whose blocks may be
        freed now."""
        return self._requests.pop(step_id, {}), self._free_after.pop(step_id, [])

    def free_later(self, request_id: str) -> bool:
        """Hold the request's blocks until the last step holding it is done; False if no
        step in flight holds it (free them now)."""
        holding = [step for step, ids in self._requests.items() if request_id in ids]
        if not holding:
            return False
        self._free_after.setdefault(max(holding), []).append(request_id)
        return True
