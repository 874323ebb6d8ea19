"""The web chat page in headless Debian Chromium (driven by the PyPI playwright package;
its own browser download is never used): a streamed reply, a cancelled one, history
restored after a reload, the API-key field, and a phone-sized screen."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from tests.stack import TandemStack
from tests.system_packages import ensure_debian_package


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    chromium = ensure_debian_package("chromium", "chromium")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"], headless=True)
        yield b
        b.close()


@pytest.fixture(scope="module")
def keyed(smollm2_dir: Path) -> Iterator[TandemStack]:
    with TandemStack(env={"TANDEM_API_KEYS": "page-key"}) as stack:
        yield stack


def wait_idle(url: str, headers: dict[str, str]) -> None:
    for _ in range(100):
        stats = httpx.get(f"{url}/stats", headers=headers).json()
        if stats["active_requests"] == 0 and stats["num_kv_blocks_in_use"] == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"engine still busy: {stats}")


def test_chat_page_streams_cancels_and_remembers(
    browser: Browser, keyed: TandemStack, tmp_path: Path
) -> None:
    context = browser.new_context(viewport={"width": 390, "height": 844})  # a phone
    page: Page = context.new_page()
    page.goto(keyed.url + "/")  # the page itself is open; the API needs the key
    expect(page.locator("#error-banner")).to_be_visible()
    expect(page.locator("#error-text")).to_contain_text("API key")
    page.click("#toggle-sidebar")  # the sidebar slides in on a narrow screen
    page.fill("#temperature", "0")  # greedy, so the first answer is known
    page.dispatch_event("#temperature", "change")
    page.fill("#api-key", "page-key")
    page.dispatch_event("#api-key", "change")
    page.click("#close-sidebar")
    expect(page.locator("#sidebar")).not_to_have_class("open")
    expect(page.locator("#model-name")).to_have_text("smollm2-135m-instruct")

    # 1. A message and its reply.
    page.fill("#prompt", "What is the capital of France?")
    page.press("#prompt", "Enter")
    reply = page.locator(".message.assistant").last
    expect(page.locator("#send")).to_be_visible(timeout=60_000)
    first_reply = reply.inner_text()
    assert "Paris" in first_reply

    # 2. A long reply, streamed and stopped mid-stream.
    page.fill("#prompt", "Write a very long story about a dragon who learns to bake.")
    page.press("#prompt", "Enter")
    second = page.locator(".message.assistant").nth(1)
    expect(second).not_to_have_text("", timeout=30_000)
    # Watch the text grow while it streams (the first, short reply can come whole within
    # one look: ~10 tokens at ~5 ms each).
    lengths = set()
    for _ in range(200):
        lengths.add(len(second.inner_text()))
        if len(lengths) > 2 or page.locator("#cancel").is_hidden():
            break
        page.wait_for_timeout(25)
    assert len(lengths) > 2, "the reply arrived at once, not streamed"
    page.click("#cancel")
    expect(page.locator(".message.assistant.stopped")).to_have_count(1)
    expect(page.locator("#send")).to_be_visible()
    stopped_text = second.inner_text()
    page.wait_for_timeout(500)
    assert second.inner_text() == stopped_text  # nothing more arrives after Stop
    wait_idle(keyed.url, {"x-api-key": "page-key"})  # the engine aborted it

    # 3. A reload restores the conversation from localStorage; the key is kept only in
    # the tab's sessionStorage, never in localStorage.
    page.screenshot(path=str(tmp_path / "chat-before-reload.png"))
    assert "page-key" not in page.evaluate("JSON.stringify(localStorage)")
    assert page.evaluate("sessionStorage.getItem('tandem.apiKey')") == "page-key"
    response = page.reload()
    assert response is not None
    csp = response.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "unsafe-inline" not in csp
    expect(page.locator(".message")).to_have_count(4)
    expect(page.locator(".message.assistant").first).to_have_text(first_reply)
    expect(page.locator("#conversations li")).to_have_count(1)
    page.screenshot(path=str(tmp_path / "chat-after-reload.png"))
    assert (tmp_path / "chat-after-reload.png").stat().st_size > 1000

    # 4. A second conversation is kept apart from the first.
    page.click("#toggle-sidebar")
    page.click("#new-chat")
    expect(page.locator(".message")).to_have_count(0)
    expect(page.locator("#conversations li")).to_have_count(2)
    context.close()
