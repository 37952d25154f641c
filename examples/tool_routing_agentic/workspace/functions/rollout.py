"""Tool-routing agent: the student decides; tool calls are executed and their results fed back.

Multi-turn: after a tool call the agent sends the tool result back and asks the student for the
final answer, so the trajectory holds two assistant turns (both trained) and a tool result (never
trained) — exactly what OPD on an agent looks like.
"""

from __future__ import annotations

import json

from functions.tools import run_tool
from opd_trainer.sdk import (
    PROMPT_MESSAGES_KEY,
    AbstractRolloutProcessor,
    AgentOutput,
    RolloutInput,
    RolloutOutput,
    TaskStatus,
    observe_processor,
)

MAX_TURNS = 3


class ToolRoutingRollout(AbstractRolloutProcessor):
    @observe_processor
    async def process(self, rollout_input: RolloutInput) -> RolloutOutput:
        resource = rollout_input.model_resource
        client = resource.openai_client()  # traced, this rollout's key, the worker's shared pool
        messages = list(rollout_input.messages)
        tool_calls_made = turns = 0
        while turns < MAX_TURNS:
            turns += 1
            response = await client.chat.completions.create(
                model=resource.model_name,
                messages=messages,
                tools=rollout_input.tools,
                max_tokens=rollout_input.sampling_params.get("max_tokens", 64),
            )
            message = response.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                tool_calls_made += 1
                try:
                    arguments = json.loads(call.function.arguments)
                except json.JSONDecodeError:
                    arguments = {}
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": call.id,
                        "content": run_tool(call.function.name, arguments),
                    }
                )
        return RolloutOutput(
            agent_output=AgentOutput(
                messages=messages,
                rollout_extra={PROMPT_MESSAGES_KEY: len(rollout_input.messages)},
                rollout_metrics={"turns": float(turns), "tool_calls": float(tool_calls_made)},
            ),
            status=TaskStatus.SUCCESS,
        )
