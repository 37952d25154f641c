"""Chat-template variables sent by a client (`enable_thinking`, `chat_template_kwargs`) reach the template."""

from __future__ import annotations

import inspect

import pytest
from chatml_tokenizer import save_chatml_tokenizer
from fastapi.testclient import TestClient

from opd_trainer.chat import RESERVED_TEMPLATE_KWARGS
from opd_trainer.rollout.chat_requests import chat_request
from opd_trainer.rollout.gateway import Gateway

# Qwen3's switch, reduced to its essentials: an empty think block when thinking is turned off.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
MESSAGES = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Gateway:
    words = [
        "[UNK]",
        "<|im_start|>",
        "<|im_end|>",
        "<think>",
        "</think>",
        "user",
        "assistant",
        "hello",
        "world",
    ]
    special = ("<|im_start|>", "<|im_end|>", "<think>", "</think>")
    folder = tmp_path_factory.mktemp("thinking-tokenizer")
    save_chatml_tokenizer(folder, THINKING_TEMPLATE, words, special)
    # No engine: these tests stop at the rendered prompt, before anything is generated.
    return Gateway("student", str(folder), [], max_tokens=16, temperature=1.0, max_length=512)


def prompt(gateway: Gateway, **body: object) -> list[int]:
    return gateway._render(chat_request({"messages": MESSAGES, **body})).prompt_ids


def think_id(gateway: Gateway) -> int:
    return int(gateway._tokenizer.convert_tokens_to_ids("<think>"))


@pytest.mark.parametrize(
    "body",
    [
        {"enable_thinking": False},  # what `extra_body={"enable_thinking": False}` sends (Bailian)
        {"chat_template_kwargs": {"enable_thinking": False}},  # vLLM's field
        {"enable_thinking": True, "chat_template_kwargs": {"enable_thinking": False}},  # the field wins
    ],
)
def test_thinking_switch_reaches_the_template(gateway: Gateway, body: dict[str, object]) -> None:
    plain = prompt(gateway)
    assert think_id(gateway) not in plain
    switched = prompt(gateway, **body)
    assert switched[: len(plain)] == plain and think_id(gateway) in switched[len(plain) :]


def test_thinking_left_on_renders_as_without_the_switch(gateway: Gateway) -> None:
    assert prompt(gateway, enable_thinking=True) == prompt(gateway)
    assert prompt(gateway, chat_template_kwargs={}) == prompt(gateway)


def test_template_arguments_the_gateway_sets_are_refused_over_http(gateway: Gateway) -> None:
    key = gateway.open_rollout("r-1")
    with TestClient(gateway.app()) as http:
        response = http.post(
            "/v1/chat/completions",
            json={"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}},
            headers={"Authorization": f"Bearer {key}"},
        )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "chat_template_kwargs" and "tokenize" in error["message"]
    assert gateway.close_rollout(key) == []


def test_reserved_names_cover_apply_chat_template_arguments() -> None:
    from transformers import PreTrainedTokenizerBase

    parameters = set(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters)
    assert parameters - {"self", "kwargs"} <= RESERVED_TEMPLATE_KWARGS


def test_prompt_token_ids_passes_template_kwargs(gateway: Gateway) -> None:
    from opd_trainer.chat import prompt_token_ids

    expected = prompt(gateway, enable_thinking=False)  # also loads the gateway's tokenizer
    assert prompt_token_ids(gateway._tokenizer, MESSAGES, None, {"enable_thinking": False}) == expected


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": MESSAGES, "n": 2}, "n"),
        ({"messages": MESSAGES, "enable_thinking": "no"}, "enable_thinking"),
        ({"messages": MESSAGES, "max_completion_tokens": "many"}, "max_completion_tokens"),
        ({"messages": MESSAGES, "tool_choice": "required"}, "tool_choice"),
        ([{"role": "user", "content": "hi"}], "body"),
    ],
)
def test_requests_the_gateway_cannot_serve_get_400_naming_the_field(
    gateway: Gateway, body: object, param: str
) -> None:
    key = gateway.open_rollout("r-bad")
    with TestClient(gateway.app()) as http:
        response = http.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert gateway.close_rollout(key) == []


def test_max_tokens_is_read_from_either_field(gateway: Gateway) -> None:
    from opd_trainer.rollout.chat_requests import asked_max_tokens

    assert asked_max_tokens(chat_request({"messages": MESSAGES, "max_tokens": 7})) == 7
    assert asked_max_tokens(chat_request({"messages": MESSAGES, "max_completion_tokens": 5})) == 5
    assert asked_max_tokens(chat_request({"messages": MESSAGES})) is None


def test_the_jobs_template_variables_apply_unless_the_request_sets_its_own(gateway: Gateway) -> None:
    plain = prompt(gateway)
    job = Gateway(
        "student",
        gateway.tokenizer_path,
        [],
        max_tokens=16,
        temperature=1.0,
        max_length=512,
        chat_template_kwargs={"enable_thinking": False},
    )
    switched = job._render(chat_request({"messages": MESSAGES})).prompt_ids
    assert switched == prompt(gateway, enable_thinking=False) != plain
    assert job._render(chat_request({"messages": MESSAGES, "enable_thinking": True})).prompt_ids == plain
    kwargs = {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": True}}
    assert job._render(chat_request(kwargs)).prompt_ids == plain


def test_the_job_spec_refuses_template_arguments_the_trainer_sets() -> None:
    from pydantic import ValidationError

    from opd_trainer.jobspec.job_spec import JobSpec

    with pytest.raises(ValidationError, match="chat_template_kwargs") as error:
        JobSpec.model_validate(
            {
                "job_name": "j",
                "model": "m",
                "teacher_model": "t",
                "training_datasets": ["train.jsonl"],
                "chat_template_kwargs": {"tokenize": True},
            }
        )
    assert "tokenize" in str(error.value)


def test_a_repeated_prompt_is_rendered_once_and_gets_the_same_ids(gateway: Gateway) -> None:
    """The n_rollouts first calls of a prompt group share one render; any change renders anew."""
    before = (gateway._prompts.hits, gateway._prompts.misses)
    first = prompt(gateway, chat_template_kwargs={"enable_thinking": False, "marker": 1})
    again = prompt(gateway, chat_template_kwargs={"enable_thinking": False, "marker": 1})
    assert again == first and again is not first
    again.append(-1)  # a caller's list is its own: the cached ids stay as rendered
    assert prompt(gateway, chat_template_kwargs={"enable_thinking": False, "marker": 1}) == first
    other = prompt(gateway, chat_template_kwargs={"enable_thinking": True, "marker": 1})
    assert other != first
    assert (gateway._prompts.hits - before[0], gateway._prompts.misses - before[1]) == (2, 2)


def test_the_prompt_cache_keeps_only_the_most_recent() -> None:
    from opd_trainer.rollout.chat_requests import RenderedPrompts

    class CountingTokenizer:
        renders = 0

        def apply_chat_template(self, messages: list[dict[str, str]], **_: object) -> str:
            CountingTokenizer.renders += 1
            return messages[0]["content"]

        def encode(self, text: str, add_special_tokens: bool) -> list[int]:
            return [len(text)]

    cache, tokenizer = RenderedPrompts(size=2), CountingTokenizer()
    for content in ("a", "bb", "a", "ccc", "a", "bb"):  # "bb" falls out when "ccc" comes in
        cache.get(tokenizer, [{"role": "user", "content": content}], None, {})
    assert (cache.hits, cache.misses, CountingTokenizer.renders) == (2, 4, 4)
