"""Tandem instances behind the real vLLM router (``vllm-router``), started as a user
starts them: ``tandem fleet``. The router's ``kv_aware`` policy knows what each instance
has cached only from the KV events the instances publish (vLLM's format)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from common.fleet import router_binary
from tests.stack import TandemStack, completion, free_port, free_port_range

MODEL = "smollm2-135m-instruct"
TOPICS = [
    "the history of tea in china",
    "how volcanoes form",
    "the rules of chess openings",
    "why the sky is blue",
    "growing tomatoes at home",
    "the life of honeybees",
    "building a wooden canoe",
    "how compilers optimise loops",
]


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[TandemStack, list[str]]]:
    instances, events = free_port_range(2), free_port_range(4)
    stack = TandemStack(
        "--replicas",
        "2",
        "--policy",
        "kv_aware",
        "--instance-base-port",
        str(instances),
        "--kv-events-base-port",
        str(events),
        "--worker-threads",
        "1",
        "--kv-cache-gb",
        "0.1",
        command="fleet",
    )
    with stack:
        yield stack, [f"http://127.0.0.1:{instances + i}" for i in range(2)]


def chat(url: str, messages: list[dict[str, str]]) -> dict[str, object]:
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    reply: dict[str, object] = r.json()
    return reply


def metric(url: str, name: str) -> float:
    """An instance's Prometheus series of ``name``, summed over their labels."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((f"{name}{{", f"{name} "))
    )


def served(url: str) -> float:
    """Requests this instance has finished."""
    return metric(url, "tandem:request_success_total")


def test_render_gives_the_prompt_tokens_the_request_is_served_with(
    fleet: tuple[TandemStack, list[str]],
) -> None:
    _, (url, _) = fleet
    messages = [{"role": "user", "content": "Name a colour."}]
    rendered = httpx.post(
        f"{url}/v1/chat/completions/render", json={"model": MODEL, "messages": messages}
    ).json()
    served_with = chat(url, messages)["usage"]
    assert isinstance(served_with, dict)
    assert rendered["num_tokens"] == len(rendered["token_ids"]) == served_with["prompt_tokens"]
    several = httpx.post(
        f"{url}/v1/completions/render", json={"model": MODEL, "prompt": ["a b", "c"]}
    ).json()
    assert [len(p["token_ids"]) for p in several] == [p["num_tokens"] for p in several]
    assert len(several) == 2
    wrong = httpx.post(f"{url}/v1/completions/render", json={"model": "nope", "prompt": "a"})
    assert wrong.status_code == 404 and wrong.json()["error"]["param"] == "model"


@contextlib.contextmanager
def discovering_router(instances: list[str]) -> Iterator[str]:
    """A second vllm-router told only the instances' URLs: it finds their event sources
    itself (/get_server_info, /kv_event_sources), as under Kubernetes discovery."""
    port = free_port()
    argv = [router_binary(), "--host", "127.0.0.1", "--port", str(port), "--policy", "kv_aware"]
    argv += ["--worker-urls", *instances, "--worker-startup-check-interval", "1"]
    argv += ["--prometheus-port", str(free_port())]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"vllm-router exited with {proc.returncode}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, "vllm-router not healthy within 60 s"
            time.sleep(0.2)
        time.sleep(1.0)  # its subscribers connect once it has asked each instance
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_instances_describe_their_event_sources(fleet: tuple[TandemStack, list[str]]) -> None:
    _, (url, other) = fleet
    info = httpx.get(f"{url}/get_server_info").json()
    assert info["model_id"] == MODEL and info["kv_block_size"] == 16
    assert info["instance_id"] != httpx.get(f"{other}/get_server_info").json()["instance_id"]
    assert httpx.get(f"{url}/get_load").json() == {"load": 0}  # power_of_two reads it
    (source,) = httpx.get(f"{url}/kv_event_sources").json().values()
    assert (source["publisher"], source["encoding"], source["schema_version"]) == (
        "zmq",
        "msgpack",
        1,
    )
    assert source["endpoint"].startswith("tcp://127.0.0.1:") and source["replay_endpoint"]


@pytest.mark.parametrize("sources", ["flags", "discovered"])
def test_kv_aware_sends_each_second_turn_where_the_first_was_cached(
    fleet: tuple[TandemStack, list[str]], sources: str
) -> None:
    """Turn 1 of conversation i goes straight to instance i % 2; turn 2 through the
    router lands on that same instance (8 of 8), and finds turn 1's blocks there. The
    router is `tandem fleet`'s (told the event sources by flags), or one told nothing
    but the instances' URLs."""
    fleet_router, instances = fleet
    with contextlib.ExitStack() as stack:
        router = fleet_router.url
        if sources == "discovered":
            router = stack.enter_context(discovering_router(instances))
        check_second_turns(router, instances, sources)


def check_second_turns(router: str, instances: list[str], tag: str) -> None:
    landed = []
    for i, topic in enumerate(TOPICS):
        home = instances[i % 2]
        ask = f"Conversation {i} ({tag}). Write a detailed essay about {topic}: its origins, key ideas and common mistakes. "
        messages = [{"role": "user", "content": ask * 3}]
        first = chat(home, messages)
        first_usage = first["usage"]
        assert isinstance(first_usage, dict)
        choices = first["choices"]
        assert isinstance(choices, list)
        messages += [
            {"role": "assistant", "content": choices[0]["message"]["content"]},
            {"role": "user", "content": "Now say it in one line."},
        ]
        before = [served(u) for u in instances]
        second = chat(router, messages)
        after = [served(u) for u in instances]
        went = [u for u, b, a in zip(instances, before, after, strict=True) if a > b]
        usage = second["usage"]
        assert isinstance(usage, dict)
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        landed.append((went == [home], cached))
        # every full block of turn 1's prompt is found again (16 tokens per block)
        assert went != [home] or cached >= first_usage["prompt_tokens"] // 16 * 16
    assert [ok for ok, _ in landed] == [True] * len(TOPICS), landed


def generated(url: str) -> float:
    """Tokens this instance has generated."""
    return metric(url, "tandem:generation_tokens_total")


def streaming(url: str, since: float) -> bool:
    """Whether this instance runs a request and has generated 30 tokens more than ``since``."""
    running = metric(url, "tandem:num_requests_running")
    return running >= 1 and generated(url) - since >= 30


def stream_to_the_end(url: str, i: int) -> str:
    """'done', or the error a stream ended with; raises nothing, so none is lost."""
    body = {
        "model": MODEL,
        "prompt": f"Request {i}: tell a long story about a lighthouse keeper.",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            if r.status_code != 200:
                return f"status {r.status_code}"
            last, error = "", ""
            for line in r.iter_lines():
                last = line or last
                # an instance whose engine dies before its API server ends a stream with an
                # error event and then [DONE], as vLLM's does
                error = error or (line if line.startswith('data: {"error"') else "")
            if error:
                return f"error event: {error[:80]}"
            return "done" if last == "data: [DONE]" else f"ended without [DONE]: {last[:80]}"
    except httpx.HTTPError as e:
        return f"{type(e).__name__}"


def test_a_replica_killed_under_load_fails_its_requests_and_the_rest_carry_on() -> None:
    """SIGKILL one instance (every process of it) while streams run on both: every stream ends (done, or an
    error for those on the dead one; none hangs), and new requests succeed on the other
    within the router's health-check interval; nothing of the dead instance is left."""
    instances, events = free_port_range(2), free_port_range(4)
    # round robin: streams on both instances (kv_aware would put a burst of equal costs
    # on one)
    args = ["--replicas", "2", "--policy", "round_robin", "--instance-base-port", str(instances)]
    args += ["--kv-events-base-port", str(events), "--worker-threads", "1", "--kv-cache-gb", "0.1"]
    with TandemStack(*args, command="fleet") as stack:
        victim = next(
            p
            for p in stack.descendants()
            if "--port" in p.cmdline()
            and p.cmdline()[p.cmdline().index("--port") + 1] == str(instances)
            and "serve" in p.cmdline()
        )
        victim_tree = [victim, *victim.children(recursive=True)]
        base = generated(f"http://127.0.0.1:{instances}")
        with ThreadPoolExecutor(6) as pool:
            streams = [pool.submit(stream_to_the_end, stack.url, i) for i in range(6)]
            # kill while the victim is streaming some of them (a fixed sleep let a fast host
            # finish every stream first). Tokens, not a running request: one killed before its
            # first byte is retried on the live instance by the router, and ends done.
            # Counted from before the streams, with one still running there at the kill.
            victim_url, deadline = f"http://127.0.0.1:{instances}", time.monotonic() + 60
            while not streaming(victim_url, since=base) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert streaming(victim_url, since=base), "no stream reached the victim"
            for p in victim_tree:  # the whole replica at once, as a node or pod dies
                p.send_signal(signal.SIGKILL)
            ends = [f.result(timeout=90) for f in streams]  # none hangs
        assert "done" in ends, ends  # those on the live instance finished
        assert any(e != "done" for e in ends), ends  # those on the dead one failed
        _, alive = psutil.wait_procs(victim_tree, timeout=15)
        assert not alive, f"left by the killed instance: {[p.cmdline() for p in alive]}"
        time.sleep(6.0)  # the fleet's router checks health every 5 s
        # ignore_eos: sampled at the default temperature, an end of text may come first
        after = [
            completion(stack.url, f"after {i}", max_tokens=4, ignore_eos=True) for i in range(4)
        ]
        assert [r["choices"][0]["finish_reason"] for r in after] == ["length"] * 4, after
        assert f"instance 0 exited with -{int(signal.SIGKILL)}" in stack.log()
