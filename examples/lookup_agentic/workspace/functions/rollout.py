"""Lookup agent: the student finds the item the user named, calls the tool on its id, and answers.

Each episode is a user request naming an item without its id; the tool backend (`lookup.run_tool`) knows
only that item (`rollout_extra.items`, name -> id), so a guessed id, another name or an id other than
the one `find_item` returned gets an error saying what was wrong, and the agent must repair it in a
later turn. Every assistant turn is trained; tool results never are. An episode whose conversation no
longer fits the job's `max_length` ends there (the gateway refuses the prompt), as a turn limit does.
"""

from __future__ import annotations

import json

import openai

from opd_trainer.demo.tool_routing.lookup import run_tool
from opd_trainer.sdk import (
    PROMPT_MESSAGES_KEY,
    AbstractRolloutProcessor,
    AgentOutput,
    RolloutInput,
    RolloutOutput,
    TaskStatus,
    observe_processor,
)

MAX_TURNS = 5  # lookup, call, answer, and two turns to repair a mistake


class LookupRollout(AbstractRolloutProcessor):
    @observe_processor
    async def process(self, rollout_input: RolloutInput) -> RolloutOutput:
        resource = rollout_input.model_resource
        client = resource.openai_client()
        items = dict(rollout_input.rollout_extra.get("items") or {})
        messages = list(rollout_input.messages)
        turns = tool_errors = 0
        context_full = False
        while turns < MAX_TURNS:
            turns += 1
            try:
                response = await client.chat.completions.create(
                    model=resource.model_name,
                    messages=messages,
                    tools=rollout_input.tools,
                    max_tokens=rollout_input.sampling_params.get("max_tokens", 64),
                )
            except openai.BadRequestError as error:  # the conversation outgrew max_length
                if "max_length" not in str(error):
                    raise
                turns -= 1
                context_full = True
                break
            message = response.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                try:
                    arguments = json.loads(call.function.arguments)
                except json.JSONDecodeError:
                    arguments = {}
                result = run_tool(call.function.name, arguments if isinstance(arguments, dict) else {}, items)
                tool_errors += '"error"' in result
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return RolloutOutput(
            agent_output=AgentOutput(
                messages=messages,
                rollout_extra={PROMPT_MESSAGES_KEY: len(rollout_input.messages)},
                rollout_metrics={
                    "turns": float(turns),
                    "tool_errors": float(tool_errors),
                    "context_full": float(context_full),
                },
            ),
            status=TaskStatus.SUCCESS,
        )
