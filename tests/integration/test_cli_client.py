"""``tandem complete``, ``tandem status`` and ``tandem chat`` as a user runs them: real
commands in subprocesses (chat in a pseudo-terminal, driven by pexpect) against the shared
server."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pexpect

from tests.stack import TandemStack, completion, free_port

ROOT = Path(__file__).resolve().parents[2]
TANDEM = [sys.executable, "-m", "common.cli"]
MODEL = "smollm2-135m-instruct"
PROMPT = ">>> "


def tandem(
    *args: str, stdin: str = "", env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*TANDEM, *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


def test_complete_streams_the_greedy_completion_to_stdout(server: TandemStack) -> None:
    prompt = "The capital of France is"
    expected = completion(server.url, prompt, max_tokens=16, temperature=0)["choices"][0]["text"]
    flags = ["--max-tokens", "16", "--temperature", "0"]
    # The prompt from stdin (no argument), the server from TANDEM_URL.
    piped = tandem("complete", *flags, stdin=prompt, env={"TANDEM_URL": server.url})
    assert (piped.returncode, piped.stderr) == (0, "")
    assert piped.stdout == expected  # the text alone: no newline added into a pipe
    given = tandem("complete", "--url", server.url, *flags, prompt)
    assert (given.returncode, given.stdout) == (0, expected)
    # A reader that leaves early (head) is no error: no traceback, exit 0.
    shell = subprocess.run(
        [
            "bash",
            "-c",
            'set -o pipefail; "$@" - | head -c 5',
            "bash",
            *TANDEM,
            "complete",
            "--url",
            server.url,
            "--max-tokens",
            "64",
        ],
        input=prompt,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert (shell.returncode, len(shell.stdout), shell.stderr) == (0, 5, "")


def test_complete_says_the_servers_error_on_stderr(server: TandemStack) -> None:
    out = tandem("complete", "--url", server.url, "--model", "no-such-model", "Hello")
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.startswith("tandem complete: 404: ") and "no-such-model" in out.stderr
    gone = f"http://127.0.0.1:{free_port()}"
    out = tandem("status", "--url", gone)
    assert out.returncode == 1 and f"cannot reach {gone}" in out.stderr


def test_status_shows_health_the_model_and_kv_usage(server: TandemStack) -> None:
    out = tandem("status", "--url", server.url)
    assert out.returncode == 0, out.stderr
    stats = httpx.get(f"{server.url}/stats", timeout=10).json()
    screen = out.stdout
    assert re.search(r"^health\s+ok \(model loaded\)$", screen, re.M), screen
    assert re.search(r"^readiness\s+ready \(unified\)$", screen, re.M), screen
    assert re.search(rf"^models\s+{MODEL} \(context \d+\)$", screen, re.M), screen
    total = stats["num_kv_blocks_total"]
    assert re.search(rf"^KV cache\s+\d+ / {total} blocks in use \(\d+\.\d%\)$", screen, re.M)
    assert re.search(r"^requests\s+\d+ running, \d+ waiting, \d+ served", screen, re.M), screen


def prompt_tokens(server: TandemStack, before: float | None = None) -> float:
    """``tandem:prompt_tokens_total``, once it has moved past ``before`` (the engine's
    counters reach the API server with its heartbeat, a beat after a reply ends)."""
    deadline = time.monotonic() + 10
    while True:
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        value = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("tandem:prompt_tokens_total{")
        )
        if value != before or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def chat_reply(server: TandemStack, messages: list[dict[str, str]]) -> dict[str, Any]:
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()
    return result


def spawn_chat(server: TandemStack, max_tokens: int) -> pexpect.spawn:
    args = ["-m", "common.cli", "chat", "--url", server.url, "--temperature", "0"]
    chat = pexpect.spawn(
        sys.executable,
        [*args, "--max-tokens", str(max_tokens)],
        cwd=str(ROOT),
        encoding="utf-8",
        timeout=120,
        dimensions=(24, 200),
    )
    chat.expect_exact(PROMPT)
    return chat


def test_chat_sends_the_whole_conversation_each_turn(server: TandemStack) -> None:
    first, second = "My name is Ada.", "What is my name?"
    chat = spawn_chat(server, max_tokens=8)
    try:
        start = prompt_tokens(server)
        chat.sendline(first)
        chat.expect_exact(PROMPT)
        shown = chat.before.replace("\r\n", "\n")
        after_first = prompt_tokens(server, start)
        chat.sendline(second)
        chat.expect_exact(PROMPT)
        after_second = prompt_tokens(server, after_first)
        chat.sendline("/exit")
        chat.expect(pexpect.EOF)
    finally:
        chat.close()
    assert chat.exitstatus == 0
    # The same turns sent by hand: the first alone, then both with the reply between.
    one = chat_reply(server, [{"role": "user", "content": first}])
    reply = one["choices"][0]["message"]["content"]
    assert reply.strip() and reply.strip() in shown
    both = chat_reply(
        server,
        [
            {"role": "user", "content": first},
            {"role": "assistant", "content": reply},
            {"role": "user", "content": second},
        ],
    )
    assert after_first - start == one["usage"]["prompt_tokens"]
    assert after_second - after_first == both["usage"]["prompt_tokens"]
    alone = chat_reply(server, [{"role": "user", "content": second}])
    assert both["usage"]["prompt_tokens"] > alone["usage"]["prompt_tokens"]


def test_ctrl_c_stops_a_reply_and_the_chat_goes_on(server: TandemStack) -> None:
    chat = spawn_chat(server, max_tokens=2000)
    try:
        chat.sendline("Write a very long essay about the history of Rome.")
        chat.expect(r"Rome\.\r\n\S")  # the reply has begun
        chat.sendintr()
        chat.expect_exact("[stopped]")
        chat.expect_exact(PROMPT)
        # The request ended in the server (the closed connection aborted it), long before
        # its 2000 tokens.
        stats = server.stats_when(lambda s: s["active_requests"] == 0, timeout_s=5)
        assert stats["active_requests"] == 0
        chat.sendline("Reply with one word: hello.")
        chat.expect(r"hello\.\r\n\s*\S")  # a reply streams
        chat.expect_exact(PROMPT, timeout=60)  # and ends
        chat.sendintr()  # at the prompt: a fresh line, the session goes on
        chat.expect_exact(PROMPT)
        chat.sendeof()
        chat.expect(pexpect.EOF)
    finally:
        chat.close()
    assert chat.exitstatus == 0
