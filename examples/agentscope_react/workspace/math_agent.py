# The seed's (002) workflow and judge functions; only the tuner import line changed
# (agentscope.tuner -> opd_trainer.tuner).
from typing import Any, Dict, Optional

from agentscope.agent import ReActAgent
from agentscope.formatter import OpenAIChatFormatter
from agentscope.message import Msg
from agentscope.model import ChatModelBase

from opd_trainer.tuner import JudgeOutput, WorkflowOutput


async def example_workflow_function(
    task: Dict,
    model: ChatModelBase,
    auxiliary_models: Optional[Dict[str, ChatModelBase]] = None,
) -> WorkflowOutput:
    agent = ReActAgent(
        name="react_agent",
        sys_prompt="You are a helpful math problem solving agent.",
        model=model,
        formatter=OpenAIChatFormatter(),
    )
    response = await agent.reply(msg=Msg("user", task["question"], role="user"))
    return WorkflowOutput(response=response)


async def example_judge_function(
    task: Dict,
    response: Any,
    auxiliary_models: Optional[Dict[str, ChatModelBase]] = None,
) -> JudgeOutput:
    ground_truth = task["answer"]
    reward = 1.0 if ground_truth in (response.get_text_content() or "") else 0.0
    return JudgeOutput(reward=reward)
