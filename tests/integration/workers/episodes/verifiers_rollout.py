"""A verifiers rollout against an episode endpoint, run in the verifiers venv (not in rollpool's: no rollpool import).

``python verifiers_rollout.py BASE_URL API_KEY MODEL``: three turns through verifiers' own
``OpenAIChatCompletionsTokenClient`` (verifiers 0.3.1, prime-rl's token-in-token-out client), each recorded as
verifiers' ``MultiTurnEnv.add_model_response`` records it (``parse_response_message``, ``parse_response_tokens``):
a tool call, the tool's answer, a user turn. Prints one JSON line: each step's ``prompt_ids`` and
``completion_ids`` and the client's warnings (a fallback from token-in-token-out to messages logs one).
tests/integration/workers/episodes/test_verifiers_live.py runs it; verifiers_venv.sh makes the venv.
"""

import asyncio
import json
import logging
import sys

from openai import AsyncOpenAI
from verifiers.legacy.clients.openai_chat_completions_token_client import OpenAIChatCompletionsTokenClient
from verifiers.legacy.types import Tool, ToolMessage, UserMessage
from verifiers.legacy.utils.response_utils import parse_response_message, parse_response_tokens

TOOLS = [Tool(name="weather", description="The weather in a city.",
              parameters={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})]


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append(record.getMessage())


async def main(base_url: str, api_key: str, model: str) -> dict:
    warnings = _Warnings()
    logging.getLogger("verifiers").addHandler(warnings)
    client = OpenAIChatCompletionsTokenClient(AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60))
    state: dict = {"trajectory": [], "model": model}
    messages: list = [UserMessage(content="Weather in Paris?")]
    steps = []
    for turn in range(3):
        response = await client.get_response(messages, model, {"max_tokens": 200, "temperature": 1.0}, TOOLS, state=state)
        completion = await parse_response_message(response)
        tokens = await parse_response_tokens(response)
        state["trajectory"].append({"prompt": list(messages), "completion": completion, "response": response, "tokens": tokens})
        steps.append({"prompt_ids": list(tokens["prompt_ids"]), "completion_ids": list(tokens["completion_ids"]),
                      "logprobs": list(tokens["completion_logprobs"]),
                      "tool_calls": [c.name for c in completion[0].tool_calls or []]})
        messages = [*messages, *completion]
        calls = completion[0].tool_calls or []
        if turn == 0 and calls:
            messages += [ToolMessage(tool_call_id=c.id, content="sunny") for c in calls]
        else:
            messages.append(UserMessage(content=f"And then {turn}?"))
    await client.close()
    return {"steps": steps, "warnings": warnings.seen}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(*sys.argv[1:4]))))
