"""Self-correcting agent: the student calls tools, reads their results (or errors) and answers.

Each episode is a user request; the tool backend (`self_correction.run_tool`) answers a call on a moved
item with an error naming its new id, and the agent must repeat the call on that id in its next turn,
then summarise the result. Every assistant turn is trained; tool results never are.
"""

from __future__ import annotations

import json

from opd_trainer.demo.tool_routing.self_correction import run_tool
from opd_trainer.sdk import (
    PROMPT_MESSAGES_KEY,
    AbstractRolloutProcessor,
    AgentOutput,
    RolloutInput,
    RolloutOutput,
    TaskStatus,
    observe_processor,
)

MAX_TURNS = 4  # call, corrected call, answer, and one turn to spare


class SelfCorrectionRollout(AbstractRolloutProcessor):
    @observe_processor
    async def process(self, rollout_input: RolloutInput) -> RolloutOutput:
        resource = rollout_input.model_resource
        client = resource.openai_client()
        moved = dict(rollout_input.rollout_extra.get("moved") or {})
        messages = list(rollout_input.messages)
        turns = tool_errors = 0
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
                try:
                    arguments = json.loads(call.function.arguments)
                except json.JSONDecodeError:
                    arguments = {}
                result = run_tool(call.function.name, arguments if isinstance(arguments, dict) else {}, moved)
                tool_errors += '"error"' in result
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return RolloutOutput(
            agent_output=AgentOutput(
                messages=messages,
                rollout_extra={PROMPT_MESSAGES_KEY: len(rollout_input.messages)},
                rollout_metrics={"turns": float(turns), "tool_errors": float(tool_errors)},
            ),
            status=TaskStatus.SUCCESS,
        )
