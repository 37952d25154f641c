"""Every field of a chat-completions request is either passed to vLLM's `SamplingParams` or refused with a
400 naming it; the key's temperature and seed are the gateway's (no engine: these stop at the sampling
parameters a call would be sampled with)."""

from __future__ import annotations

from typing import Any

import pytest
from chatml_tokenizer import save_chatml_tokenizer
from fastapi.testclient import TestClient
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

from opd_trainer.rollout.chat_requests import (
    IGNORED_EXTRAS,
    NOT_SERVED,
    InvalidRequest,
    chat_request,
    template_kwargs,
)
from opd_trainer.rollout.gateway import Gateway

MESSAGES = [{"role": "user", "content": "hello world"}]
WORDS = ["[UNK]", "<|im_start|>", "<|im_end|>", "user", "assistant", "hello", "world"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
JOB_MAX_TOKENS = 16

# What the gateway serves of vLLM's request model: read for the prompt, the answer or the sampling.
SERVED = {
    # the conversation and how it is rendered
    "messages", "model", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
    "reasoning_effort", "user", "request_id", "session_id",
    # the answer
    "n", "stream", "stream_options", "stream_interval", "logprobs", "top_logprobs",
    "return_tokens_as_token_ids", "return_token_ids", "skip_special_tokens", "spaces_between_special_tokens",
    # sampling
    "temperature", "seed", "max_tokens", "max_completion_tokens", "top_p", "top_k", "min_p",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "stop", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "bad_words", "allowed_token_ids",
    "response_format", "structured_outputs", "repetition_detection",
}  # fmt: skip


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Gateway:
    folder = save_chatml_tokenizer(tmp_path_factory.mktemp("sampling-tokenizer"), TEMPLATE, WORDS)
    return Gateway("student", str(folder), [], max_tokens=JOB_MAX_TOKENS, temperature=0.7, max_length=512)


def prepared_sampling(gateway: Gateway, key: str, **body: Any) -> Any:
    import asyncio

    return asyncio.run(gateway._prepare(key, chat_request({"messages": MESSAGES, **body}))).sampling


def test_every_request_field_is_served_or_refused() -> None:
    """A field vLLM adds to its request model fails this until it is served or named in NOT_SERVED."""
    fields = set(ChatCompletionRequest.model_fields)
    assert not SERVED & set(NOT_SERVED)
    assert fields == SERVED | set(NOT_SERVED), f"unclassified: {sorted(fields - SERVED - set(NOT_SERVED))}"


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"stop": "world"}, {"stop": ["world"]}),
        (
            {"stop": ["a", "bb"], "include_stop_str_in_output": True},
            {"stop": ["a", "bb"], "include_stop_str_in_output": True},
        ),
        ({"stop_token_ids": [2]}, {"stop_token_ids": [2]}),
        ({"top_p": 0.5}, {"top_p": 0.5}),
        ({"top_k": 3}, {"top_k": 3}),
        ({"min_p": 0.1}, {"min_p": 0.1}),
        (
            {"presence_penalty": 0.5, "frequency_penalty": -0.5},
            {"presence_penalty": 0.5, "frequency_penalty": -0.5},
        ),
        ({"repetition_penalty": 1.3}, {"repetition_penalty": 1.3}),
        ({"logit_bias": {"5": -100}}, {"logit_bias": {5: -100}}),
        ({"bad_words": ["world"]}, {"bad_words": ["world"]}),
        ({"allowed_token_ids": [5, 6]}, {"allowed_token_ids": [5, 6]}),
        ({"min_tokens": 2, "ignore_eos": True}, {"min_tokens": 2, "ignore_eos": True}),
        ({"seed": 11}, {"seed": 11}),
        ({"logprobs": True}, {"logprobs": 0}),
        ({"logprobs": True, "top_logprobs": 5}, {"logprobs": 5}),
        ({"max_completion_tokens": 4}, {"max_tokens": 4}),
        ({"max_tokens": 5}, {"max_tokens": 5}),
        ({"max_completion_tokens": 400}, {"max_tokens": JOB_MAX_TOKENS}),  # capped by the job
        ({"spaces_between_special_tokens": False}, {"spaces_between_special_tokens": False}),
        ({"response_format": {"type": "json_object"}}, {"structured_outputs.json_object": True}),
    ],
)
def test_sampling_fields_reach_vllms_sampling_params(
    gateway: Gateway, body: dict[str, Any], expected: dict[str, Any]
) -> None:
    key = gateway.open_rollout("r-fields")
    params = prepared_sampling(gateway, key, **body)
    for name, value in expected.items():
        got = params
        for part in name.split("."):
            got = getattr(got, part)
        assert got == value, name
    # The learner's temperature: the key's (here the job's), whatever the request says.
    assert params.temperature == 0.7
    gateway.close_rollout(key)


def test_the_keys_temperature_and_seed_apply_unless_the_request_seeds(gateway: Gateway) -> None:
    key = gateway.open_rollout("r-greedy", temperature=0.0, seed=100)
    first = prepared_sampling(gateway, key, temperature=0.9, top_p=0.5)
    second = prepared_sampling(gateway, key)
    seeded = prepared_sampling(gateway, key, seed=7)
    # Greedy stays greedy (vLLM then drops top-p), and unseeded calls get the key's seed + call index.
    assert (first.temperature, first.top_p, first.seed) == (0.0, 1.0, 100)
    assert (second.seed, seeded.seed) == (101, 7)
    # A refused request is not a call: the next unseeded call still gets the next index.
    with pytest.raises(InvalidRequest):
        prepared_sampling(gateway, key, top_k=-3)
    assert prepared_sampling(gateway, key).seed == 103
    gateway.close_rollout(key)


NOT_DEFAULT: dict[str, Any] = {
    "use_beam_search": True,
    "length_penalty": 0.5,
    "echo": True,
    "add_generation_prompt": False,
    "continue_final_message": True,
    "add_special_tokens": True,
    "chat_template": "{{ messages }}",
    "documents": [{"title": "a", "text": "b"}],
    "media_io_kwargs": {"image": {"a": 1}},
    "mm_processor_kwargs": {"a": 1},
    "truncate_prompt_tokens": 5,
    "truncation_side": "left",
    "prompt_logprobs": 1,
    "logprob_token_ids": [1],
    "thinking_token_budget": 8,
    "include_reasoning": False,
    "watermarking": True,
    "vllm_xargs": {"a": 1},
    "kv_transfer_params": {"a": 1},
    "ec_transfer_params": {"a": 1},
    "priority": 1,
    "cache_salt": "salt",
    "return_prompt_text": True,
    "return_token_offsets": True,
    "mm_payload": "none",
    "return_mm_kwargs": None,  # an alias of mm_payload: checked as mm_payload below
    "routed_experts_prompt_start": 1,
}


@pytest.mark.parametrize("name", sorted(NOT_SERVED))
def test_fields_not_served_are_refused_over_http_naming_them(gateway: Gateway, name: str) -> None:
    body: dict[str, Any] = {"messages": MESSAGES, name: NOT_DEFAULT[name]}
    param = name
    if name == "return_mm_kwargs":
        body[name], param = False, "mm_payload"
    if name == "logprob_token_ids":
        body["logprobs"] = True
    key = gateway.open_rollout("r-refused")
    with TestClient(gateway.app()) as http:
        response = http.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == 400 and error["type"] == "BadRequestError"
    assert param in error["message"]
    assert gateway.close_rollout(key) == []


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),  # the legacy form of tools
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"stop": [""]}, "stop"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"logit_bias": {"9999": 5}}, "logit_bias"),
        ({"logit_bias": {"hello": 5}}, "logit_bias"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ],
)
def test_unknown_fields_and_bad_values_are_refused_naming_them(
    gateway: Gateway, body: dict[str, Any], param: str
) -> None:
    key = gateway.open_rollout("r-bad-value")
    with TestClient(gateway.app()) as http:
        response = http.post(
            "/v1/chat/completions",
            json={"messages": MESSAGES, **body},
            headers={"Authorization": f"Bearer {key}"},
        )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert gateway.close_rollout(key) == []


def test_fields_that_change_nothing_are_accepted() -> None:
    for name in IGNORED_EXTRAS - {"enable_thinking"}:
        chat_request({"messages": MESSAGES, name: "x"})
    with pytest.raises(InvalidRequest):
        chat_request({"messages": MESSAGES, "not_a_field": 1})


def test_reasoning_effort_reaches_the_template_as_vllm_passes_it(gateway: Gateway) -> None:
    assert template_kwargs(chat_request({"messages": MESSAGES, "reasoning_effort": "none"})) == {
        "reasoning_effort": "none",
        "enable_thinking": False,
    }
    request = chat_request(
        {"messages": MESSAGES, "reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": False}}
    )
    assert template_kwargs(request) == {"reasoning_effort": "low", "enable_thinking": False}


def test_answer_logprobs_list_the_k_most_likely_tokens_besides_the_sampled_one(gateway: Gateway) -> None:
    """As vLLM's server builds them, but the alternatives are the k most likely by rank even when the
    sampled token is not among them (vLLM lists the sampled token first and would keep it)."""
    from vllm.logprobs import Logprob

    from opd_trainer.rollout.gateway import chat_logprobs

    steps = [
        {
            5: Logprob(-3.0, rank=4, decoded_token="hello"),
            6: Logprob(-0.1, 1, "world"),
            3: Logprob(-2.5, 2, "user"),
        },
        {6: Logprob(-0.2, rank=1, decoded_token="world"), 5: Logprob(-1.9, 2, "hello")},
    ]
    logprobs = chat_logprobs([5, 6], steps, 2, gateway._load_tokenizer(), as_token_ids=False)
    first, second = logprobs.content or []
    assert (first.token, first.logprob, first.bytes) == ("hello", -3.0, list(b"hello"))
    assert [(t.token, t.logprob) for t in first.top_logprobs] == [("world", -0.1), ("user", -2.5)]
    assert [t.token for t in second.top_logprobs] == ["world", "hello"]
    as_ids = chat_logprobs([6], steps[1:], 1, gateway._load_tokenizer(), as_token_ids=True)
    assert [(c.token, [t.token for t in c.top_logprobs]) for c in as_ids.content or []] == [
        ("token_id:6", ["token_id:6"])
    ]


def test_a_reply_leaves_the_teacher_one_token_of_room_under_max_length(tmp_path: Any) -> None:
    """Prompt + reply stay one token under `max_length` (the teacher's prompt logprobs need one more), and
    a prompt that leaves no room for a reply is refused naming `messages`."""
    folder = save_chatml_tokenizer(tmp_path, TEMPLATE, WORDS)
    probe = Gateway("student", str(folder), [], max_tokens=JOB_MAX_TOKENS, temperature=1.0, max_length=512)
    prompt = len(probe._render(chat_request({"messages": MESSAGES})).prompt_ids)
    for max_length, room in ((prompt + 4, 3), (prompt + 2, 1)):
        gateway = Gateway(
            "student", str(folder), [], max_tokens=JOB_MAX_TOKENS, temperature=1.0, max_length=max_length
        )
        assert prepared_sampling(gateway, gateway.open_rollout(f"r{room}")).max_tokens == room
    full = Gateway(
        "student", str(folder), [], max_tokens=JOB_MAX_TOKENS, temperature=1.0, max_length=prompt + 1
    )
    with pytest.raises(InvalidRequest) as refused:
        prepared_sampling(full, full.open_rollout("r0"))
    assert refused.value.param == "messages" and "max_length" in str(refused.value)
