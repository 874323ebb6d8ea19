"""The OpenAI Agents SDK's own agent loop against a running stack, over chat completions
and over the Responses API: an agent with two function tools calls one (the first turn
requires a call), gets its result back and runs to a final answer. What the tools were
called with is recorded, so the test sees the SDK really ran them."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)

from tests.stack import TandemStack

MODEL = "smollm2-135m-instruct"


def make_agent(model: Any, calls: list[tuple[str, str]]) -> Agent[Any]:
    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(("get_weather", city))
        return f"It is 21 degrees and sunny in {city}."

    @function_tool
    def get_time(city: str) -> str:
        """The local time in a city."""
        calls.append(("get_time", city))
        return f"It is noon in {city}."

    return Agent(
        name="assistant",
        instructions="You answer questions about cities with your tools.",
        tools=[get_weather, get_time],
        model=model,
        # The first turn must call a tool; the SDK resets the choice to auto after a call
        # (reset_tool_choice), so the next turn may answer in text.
        model_settings=ModelSettings(
            tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=200
        ),
    )


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_an_agent_calls_its_tools_and_answers(server: TandemStack, api: str) -> None:
    set_tracing_disabled(True)  # no exporter: nothing may leave the machine
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    model: Any = (
        OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
        if api == "chat_completions"
        else OpenAIResponsesModel(model=MODEL, openai_client=client)
    )
    calls: list[tuple[str, str]] = []
    result = Runner.run_sync(make_agent(model, calls), "What is the weather in Paris?", max_turns=6)
    assert calls and all(name in ("get_weather", "get_time") for name, _ in calls), calls
    assert all(isinstance(city, str) and city for _, city in calls)
    assert isinstance(result.final_output, str) and result.final_output.strip()
    kinds = [item.type for item in result.new_items]
    assert kinds.index("tool_call_item") < kinds.index("tool_call_output_item")
    assert kinds[-1] == "message_output_item"
