"""The web console (/console) driven in headless Chromium (Debian's `chromium`, through Playwright).
Most tests run against a job server that runs no training (its jobs stay queued): the trajectory view
reads trajectories.jsonl written into a queued job's run dir the way the driver writes it
(`scored_trajectories` over rollouts and scored segments, a fixture of the storage format), and the
validation view reads validation_trajectories.jsonl written the same way (`validation_records`). The
last one follows a real job on the session's training server (tests/conftest.py): its curve while it
trains, then the trajectories its driver wrote. Screenshots go to the test's tmp dir."""

import dataclasses
import shutil
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from apiserver import Server, Tenant

from opd_trainer.driver.validation import validation_records
from opd_trainer.jobspec.dataset import Sample
from opd_trainer.records import LLMCall
from opd_trainer.rollout.runner import RolloutResult
from opd_trainer.rollout.trajectory_view import scored_trajectories
from opd_trainer.storage.run_dir import RunDir

sync_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture
def browser() -> Iterator["sync_api.Browser"]:
    if not Path(CHROMIUM).exists():
        pytest.skip("needs Debian's chromium (apt-get install chromium)")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


def _open(browser: "sync_api.Browser", server: Server, key: str) -> "sync_api.Page":
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    page.goto(f"{server.url}/console/")
    page.fill("#key", key)
    page.click("text=Open")
    page.wait_for_selector("h1:has-text('Jobs')")
    return page


def test_console_lists_opens_and_cancels_a_job_and_hides_it_from_other_tenants(
    browser: "sync_api.Browser", server: Server, tenant: Tenant, other_tenant: Tenant, tmp_path: Path
) -> None:
    job = tenant.job(job_name="console-test")
    page = _open(browser, server, tenant.key)
    row = page.locator(f"tr.job[data-id='{job['id']}']")
    row.wait_for()
    assert "queued" in row.inner_text() and "console-test" in row.inner_text()
    page.screenshot(path=tmp_path / "jobs.png")

    row.click()
    page.wait_for_selector("#status")
    assert page.inner_text("#status") == "queued"
    assert '"job_name": "console-test"' in page.inner_text("pre")
    page.wait_for_selector("#events tr")  # the event stream's validating_files/queued events
    page.click("button[data-act='cancel']")
    page.wait_for_function("document.getElementById('status').textContent === 'cancelled'")
    assert tenant.http.get(f"/v1/opd/jobs/{job['id']}").json()["status"] == "cancelled"
    page.screenshot(path=tmp_path / "job.png")

    other = _open(browser, server, other_tenant.key)
    assert other.locator("tr.job").count() == 0
    assert job["id"] not in other.content()
    other.goto(f"{server.url}/console/#/job/{job['id']}")
    other.wait_for_function("document.getElementById('error').textContent.length > 0")
    assert "no job with id" in other.inner_text("#error")  # the API's own 404 message, as is
    assert "console-test" not in other.content()
    assert other_tenant.http.get(f"/v1/opd/jobs/{job['id']}").status_code == 404
    other.screenshot(path=tmp_path / "other_tenant.png")


class WordTokenizer:
    """Token id N is the word `WORDS[N]` (what the driver's tokenizer decodes, one id at a time)."""

    WORDS = ("<pad>", "I", " will", " call", " get_weather", "(", "Paris", ")", " It", " is", " sunny", ".")

    def decode(self, token_ids: list[int]) -> str:
        return "".join(self.WORDS[i] for i in token_ids)


def _tool_rollout(
    index: int, ratios: list[list[float]], reward: float
) -> tuple[RolloutResult, list[LLMCall]]:
    """A two-call agent rollout (a tool call, the tool's result, the answer) and its scored segments; the
    teacher's top-1 is token 10 (" sunny") with p = 0.6 everywhere."""
    call_msg = {
        "role": "assistant",
        "content": "I will call",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    }
    answer = {"role": "assistant", "content": "It is sunny."}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        call_msg,
        {"role": "tool", "name": "get_weather", "tool_call_id": "c1", "content": "TOOL_OUTPUT 21C"},
        answer,
    ]
    calls = [
        LLMCall([1], [1, 2, 3, 4, 5, 6, 7], [-0.5] * 7, response_message=call_msg),
        LLMCall([1, 2], [8, 9, 10, 11], [-0.5] * 4, response_message=answer),
    ]
    segments = []
    for call, ratio in zip(calls, ratios, strict=True):
        size = len(call.completion_token_ids)
        top_ids, top_logprobs = (
            np.full((size, 2), [10, 0], np.int32),
            np.log(np.full((size, 2), [0.6, 0.1], np.float32)),
        )
        segments.append(
            dataclasses.replace(
                call,
                teacher_logprobs=[-0.5 - r for r in ratio],
                rollout_id=index,
                teacher_top_ids=top_ids,
                teacher_top_logprobs=top_logprobs,
            )
        )
    sample = Sample("train.jsonl", index, messages[:1], None, {"sample_id": f"weather-{index}"})
    result = RolloutResult(
        0,
        index,
        f"r{index}",
        sample,
        calls=calls,
        messages=messages,
        reward=reward,
        component_rewards={"correct": reward},
    )
    return result, segments


def _write_trajectories(server: Server, job_id: str) -> None:
    """Step 1: a rollout the teacher disagrees with (+1.5 at " get_weather", −1.5 at " sunny") and a
    calmer one; step 2: one more, so the step selector has two steps."""
    loud = _tool_rollout(0, [[0.1, 0.2, 0.0, 1.5, 0.3, 0.2, 0.1], [0.0, 0.2, -1.5, 0.1]], reward=0.2)
    # Its tool call is where it parted from a better sibling: hindsight -1 and the rejected side of a pair.
    loud[1][0] = dataclasses.replace(loud[1][0], hindsight=-1.0, preference_pairs=((0, -1),))
    # ... of a pair whose chosen side is a beacon's rewrite of it (trained by the preference term only).
    rewrite = dataclasses.replace(
        loud[1][0],
        completion_token_ids=[1, 2],
        text="get_weather(city=Paris, unit=C)",
        preference_pairs=((0, 1),),
        distilled=False,
        beacon="Hindsight beacon (...): the tool answered that it needs a unit.",
    )
    calm = _tool_rollout(1, [[0.0] * 7, [0.05] * 4], reward=0.9)
    later = _tool_rollout(0, [[0.01] * 7, [0.01] * 4], reward=1.0)
    run_dir = RunDir(server.data_dir / "runs" / job_id)
    run_dir.root.mkdir(parents=True, exist_ok=True)
    step1: list[Any] = scored_trajectories(
        [loud[0], calm[0]], loud[1] + calm[1], WordTokenizer(), step=1, rewrites=[rewrite]
    )
    run_dir.trajectories(step1 + scored_trajectories([later[0]], later[1], WordTokenizer(), step=2))


def _background(page: "sync_api.Page", selector: str) -> str:
    return page.eval_on_selector(selector, "e => getComputedStyle(e).backgroundColor")


def test_trajectory_view_colours_trained_tokens_leaves_tool_output_plain_and_sorts_by_step_and_divergence(
    browser: "sync_api.Browser", server: Server, tenant: Tenant, other_tenant: Tenant, tmp_path: Path
) -> None:
    job = tenant.job(job_name="console-trajectories")
    _write_trajectories(server, job["id"])
    page = _open(browser, server, tenant.key)
    page.goto(f"{server.url}/console/#/job/{job['id']}/trajectories")
    page.wait_for_selector("section.trajectory")
    assert page.locator("#traj-step option").all_inner_texts() == ["1", "2"]
    assert page.locator("section.trajectory").count() == 1  # the latest step first
    assert page.locator("#legend").is_visible() and "teacher disagrees" in page.inner_text("#legend")

    page.select_option("#traj-step", "1")  # by divergence, highest first, by default
    page.wait_for_function("document.querySelectorAll('section.trajectory').length === 2")
    heads = page.locator("section.trajectory h2").all_inner_texts()
    assert "weather-0" in heads[0] and "weather-1" in heads[1]
    first = page.locator("section.trajectory").first
    tokens = first.locator(".turn.trained .tok")
    assert tokens.count() == 11 and "get_weather" in first.locator(".turn.trained").first.inner_text()
    red = _background(page, "section.trajectory .turn.trained[data-call='0'] .tok[data-i='3']")
    blue = _background(page, "section.trajectory .turn.trained[data-call='1'] .tok[data-i='2']")
    assert red.startswith("rgba(178, 24, 43") and blue.startswith("rgba(33, 102, 172"), (red, blue)
    title = tokens.nth(3).get_attribute("title") or ""
    assert '" get_weather"' in title and "+1.500" in title and '" sunny"' in title and "p = 0.600" in title
    signals = first.locator(".turn.trained .signal")
    assert signals.count() == 1  # the answer turn carries the distillation only
    assert signals.first.inner_text() == "hindsight -1.000 · preference: rejected"
    rewrites = first.locator(".turn.trained .rewrite")
    assert rewrites.count() == 1 and "preferred rewrite" in rewrites.first.inner_text()
    rewrites.first.locator("summary").click()  # folded until opened
    opened = rewrites.first.inner_text()
    assert "get_weather(city=Paris, unit=C)" in opened and "needs a unit" in opened
    tool = first.locator(".turn.tool")
    assert tool.locator(".tok").count() == 0 and "no loss" in tool.inner_text()
    assert "TOOL_OUTPUT 21C" in tool.inner_text()
    assert _background(page, "section.trajectory .turn.tool") == "rgb(244, 244, 244)"  # no colour scale
    assert (
        first.locator(".turn.user .tok").count() == 0
        and "no loss" in first.locator(".turn.user").inner_text()
    )

    first.locator(".tokens").first.focus()  # the hover text by keyboard
    for _ in range(4):
        page.keyboard.press("ArrowRight")
    assert "log-ratio +1.500" in first.locator(".tokinfo").first.inner_text()
    assert page.evaluate("document.documentElement.scrollWidth") <= 1280  # nothing wider than the window
    page.screenshot(path=tmp_path / "trajectories.png", full_page=True)

    page.select_option("#traj-sort", "divergence-asc")
    page.wait_for_function(
        "document.querySelector('section.trajectory h2').textContent.includes('weather-1')"
    )
    page.select_option("#traj-sort", "reward-desc")
    page.wait_for_function(
        "document.querySelector('section.trajectory h2').textContent.includes('weather-1')"
    )
    assert "reward 0.900" in page.locator("section.trajectory .facts").first.inner_text()
    page.screenshot(path=tmp_path / "trajectories_by_reward.png", full_page=True)

    other = _open(browser, server, other_tenant.key)
    other.goto(f"{server.url}/console/#/job/{job['id']}/trajectories")
    other.wait_for_function("document.getElementById('error').textContent.length > 0")
    assert "no job with id" in other.inner_text("#error") and "weather-0" not in other.content()


class _OneTokenReplies:
    """A tokenizer for `_validation_rollout`'s replies: each reply is one token, decoded as written."""

    def __init__(self) -> None:
        self.texts: dict[int, str] = {}

    def token(self, text: str) -> int:
        self.texts[len(self.texts) + 100] = text
        return len(self.texts) + 99

    def decode(self, ids: list[int]) -> str:
        return "".join(self.texts[i] for i in ids)


REPLIES = _OneTokenReplies()


def _validation_rollout(index: int, answer: str, score: float) -> RolloutResult:
    """A greedy validation rollout of sample `q<index>` that answered `answer` (one token, logprob -0.1),
    scored `score`."""
    prompt = [{"role": "user", "content": f"PROMPT {index}: what is {index} + 2?"}]
    sample = Sample("valid.jsonl", index, prompt, None, {"sample_id": f"q{index}"})
    reply = {"role": "assistant", "content": answer}
    call = LLMCall([1], [REPLIES.token(answer)], [-0.1], response_message=reply)
    return RolloutResult(
        index, index, f"eval-r{index}", sample, calls=[call], messages=[*prompt, reply], eval_score=score
    )


def _scored(results: list[RolloutResult], divergences: list[float]) -> list[LLMCall]:
    """The rollouts' calls as the teacher scored them, each reply's one token at the given log-ratio."""
    return [
        dataclasses.replace(r.calls[0], teacher_logprobs=[-0.1 - d], rollout_id=r.index)
        for r, d in zip(results, divergences, strict=True)
    ]


def _write_validation(server: Server, job_id: str) -> None:
    """Three passes as a job writes them: the teacher and the student before training at step 0 (q0..q2),
    and step 2's student, recorded for q0 and q1 only; the students' replies scored by the teacher
    (step 2: q0 at log-ratio +0.5, q1 at +2.0)."""
    run_dir = RunDir(server.data_dir / "runs" / job_id)
    run_dir.root.mkdir(parents=True, exist_ok=True)
    passes = [
        (0, "teacher", "teacher", [_validation_rollout(i, f"TEACHER {i + 2}", 1.0) for i in range(3)]),
        (0, "student before", "student", [_validation_rollout(i, f"BEFORE {i}", 0.0) for i in range(3)]),
        (
            2,
            "step 2",
            "student",
            [_validation_rollout(0, "AFTER 2", 1.0), _validation_rollout(1, "BEFORE 1", 0.0)],
        ),
    ]
    divergences = {"teacher": None, "student before": [1.0, 1.0, 1.0], "step 2": [0.5, 2.0]}
    for step, label, model, results in passes:
        given = divergences[label]
        scored = None if given is None else _scored(results, given)
        run_dir.add_validation_trajectories(validation_records(results, step, label, model, scored, REPLIES))


def _sides(page: "sync_api.Page", sample_id: str) -> list[str]:
    return page.locator(f"section.pair[data-sample='{sample_id}'] .side").all_inner_texts()


def test_validation_view_shows_two_passes_side_by_side_with_their_scores(
    browser: "sync_api.Browser", server: Server, tenant: Tenant, other_tenant: Tenant, tmp_path: Path
) -> None:
    job = tenant.job(job_name="console-validation")
    _write_validation(server, job["id"])
    page = _open(browser, server, tenant.key)
    asked: list[str] = []
    page.on("request", lambda r: asked.append(r.url) if "/validation_trajectories" in r.url else None)
    page.goto(f"{server.url}/console/#/job/{job['id']}")
    page.click("text=Validation side by side")  # linked from the job's page
    page.wait_for_selector("section.pair")
    # By default the first and the latest student validation; only the samples both recorded.
    assert page.locator("#val-a option:checked").inner_text() == "step 0 · student before"
    assert page.locator("#val-b option:checked").inner_text() == "step 2"
    assert page.locator("section.pair").count() == 2 and "1 in only one" in page.inner_text("#val-count")
    left, right = _sides(page, "q0")
    assert "BEFORE 0" in left and "score 0.000" in left and "AFTER 2" in right and "score 1.000" in right
    assert "reward" not in left  # no reward components: no reward shown
    assert "replies differ" in page.inner_text("section.pair[data-sample='q0'] h2")
    assert "same reply" in page.inner_text("section.pair[data-sample='q1'] h2")
    assert "PROMPT 0" not in left + right  # the prompt is shown once, folded, above both
    assert "PROMPT 0" in page.locator("section.pair[data-sample='q0'] details").text_content()
    assert page.evaluate("document.documentElement.scrollWidth") <= 1280
    # The student's replies show the teacher's view of each token (scored, not trained), with the legend.
    token = page.locator("section.pair[data-sample='q0'] .side").nth(1).locator(".tok")
    assert token.inner_text() == "AFTER 2" and "log-ratio +0.500" in token.get_attribute("title")
    assert token.evaluate("e => getComputedStyle(e).backgroundColor").startswith("rgba(178, 24, 43, ")
    assert "divergence +0.500" in right and "not trained" in right
    assert page.locator("#legend").is_visible()
    page.screenshot(path=tmp_path / "validation.png", full_page=True)

    # Browsed by divergence: the pair whose right-hand reply the teacher disagrees with most comes first.
    page.select_option("#val-sort", "divergence-desc")
    page.wait_for_function("document.querySelector('section.pair').dataset.sample === 'q1'")
    assert page.locator("#val-sort option:checked").inner_text() == "right's divergence, highest first"
    page.select_option("#val-sort", "recent-asc")
    page.wait_for_function("document.querySelector('section.pair').dataset.sample === 'q0'")

    page.focus("#val-b")  # by keyboard: the right side goes up to the teacher at step 0, keeping the focus
    for expected in ("0:student before", "0:teacher"):  # each drawn before the next key
        page.keyboard.press("ArrowUp")
        page.wait_for_function(
            "e => { const s = document.querySelectorAll('section.pair .side');"
            " return s.length > 1 && s[1].dataset.pass === e && document.activeElement.id === 'val-b'; }",
            arg=expected,
        )
    assert page.locator("section.pair").count() == 3
    left, right = _sides(page, "q2")
    assert "BEFORE 2" in left and "TEACHER 4" in right and "score 1.000" in right
    assert page.locator("section.pair[data-sample='q2'] .side").nth(1).locator(".tok").count() == 0
    page.focus("#val-swap")
    page.keyboard.press("Enter")
    page.wait_for_function("document.querySelector('#val-a option:checked').textContent.includes('teacher')")
    assert "TEACHER 4" in _sides(page, "q2")[0]

    schema = tenant.http.get("/openapi.json").json()
    declared = {
        p["name"]
        for p in schema["paths"]["/v1/opd/jobs/{job_id}/validation_trajectories"]["get"]["parameters"]
    }
    used = {name for url in asked for name in urllib.parse.parse_qs(urllib.parse.urlparse(url).query)}
    assert used and used <= declared, (used, declared)

    other = _open(browser, server, other_tenant.key)
    other.goto(f"{server.url}/console/#/job/{job['id']}/validation")
    other.wait_for_function("document.getElementById('error').textContent.length > 0")
    assert "no job with id" in other.inner_text("#error") and "BEFORE 0" not in other.content()


def _points(page: "sync_api.Page", series: str) -> int:
    """Points drawn on the console's curve of `series` (e.g. `train:reverse_kl`); 0 before it exists."""
    return int(
        page.evaluate(
            "id => document.getElementById('chart-' + id)?.data?.[0]?.x?.length ?? 0",
            series,
        )
    )


def test_a_real_agentic_job_moves_its_curve_live_shows_its_tokens_and_is_cancelled_from_the_page(
    browser: "sync_api.Browser", training_server: Server, trained_models: Any, tmp_path: Path
) -> None:
    """The session's training server (real Ray, vLLM, DeepSpeed) runs the example tool-routing agent
    while the console follows it: the jobs list shows the job, its reverse-KL curve gains points from
    the event stream without a reload, a step's trajectories show the student's tokens coloured by the
    teacher and the tools' answers uncoloured, so does the student's validation before training, and
    Cancel on its page stops it."""
    from apiserver import cancel_unfinished, create_key

    from opd_trainer.client import OPDClient

    key = create_key(training_server.url, "console-live")
    client = OPDClient(training_server.url, key)
    validation = tmp_path / "validation.jsonl"  # 8 samples: the teacher's and the student's pass at start
    lines = (trained_models.data_dir / "validation.jsonl").read_text().splitlines()[:8]
    validation.write_text("\n".join(lines) + "\n")
    engine = {"kv_cache_memory_bytes": 134217728, "dtype": "float32"}
    agent = Path(__file__).resolve().parents[2] / "examples" / "tool_routing_agentic" / "workspace"
    job = client.submit(
        {
            "job_name": "console-live",
            "model": str(trained_models.student),
            "teacher_model": str(trained_models.teacher),
            "training_datasets": [str(trained_models.data_dir / "train.jsonl")],
            "validation_datasets": [str(validation)],
            "functions": [
                {
                    "name": "agent",
                    "type": "rollout",
                    "fcmodel": {"zipdir": str(agent), "classpath": "functions.rollout.ToolRoutingRollout"},
                }
            ],
            # Far longer than the test (50 steps once finished before the click on a slower machine): the
            # page cancels it. Validated before training only (eval_steps beyond max_steps).
            "hyper_parameters": {
                "max_steps": 2000,
                "batch_size": 4,
                "n_rollouts": 2,
                "max_tokens": 48,
                "eval_steps": 5000,
            },
            "resources": {"student": engine, "teacher": engine, "learner_gpus": 0},
        }
    )
    try:
        page = _open(browser, training_server, key)
        page.locator(f"tr.job[data-id='{job.id}']").wait_for()
        page.goto(f"{training_server.url}/console/#/job/{job.id}")
        page.wait_for_selector("#status")
        seen = _points(page, "train:reverse_kl")  # 0 while the job starts (or what it has so far)
        page.wait_for_function(
            "id => (document.getElementById('chart-' + id)?.data?.[0]?.x?.length ?? 0) >= 3",
            arg="train:reverse_kl",
            timeout=600_000,
        )
        assert seen < 3 <= _points(page, "train:reverse_kl")  # drawn live, from the event stream
        page.screenshot(path=tmp_path / "job_live.png", full_page=True)

        # A step in which the agent ran a tool (the tiny student calls one in ~30 % of its replies: in 24
        # rollouts, all but certain).
        recorded = client.trajectories(job.id, limit=200)
        with_tools = sorted({t["step"] for t in recorded if any(m["role"] == "tool" for m in t["messages"])})
        assert with_tools, "no rollout of the first steps ran a tool"
        page.goto(f"{training_server.url}/console/#/job/{job.id}/trajectories?step={with_tools[0]}")
        page.wait_for_selector("section.trajectory .turn.trained .tok")
        colours = page.eval_on_selector_all(
            "section.trajectory .turn.trained .tok",
            "els => els.map(e => getComputedStyle(e).backgroundColor)",
        )
        # Every trained token is on the blue-white-red scale, and the tiny teacher (exact match 0.95 to the
        # student's 0.30) disagrees clearly with some: a log-ratio of 0.45 or more is 20 % opaque.
        scale = ("rgba(33, 102, 172, ", "rgba(178, 24, 43, ")
        assert colours and all(c.startswith(scale) for c in colours), colours[:5]
        assert max(float(c.rsplit(",", 1)[1].rstrip(")")) for c in colours) >= 0.2, colours[:5]
        tools = page.locator("section.trajectory .turn.tool")
        assert tools.count() >= 1 and tools.locator(".tok").count() == 0
        assert all("no loss" in text for text in tools.all_inner_texts())
        page.screenshot(path=tmp_path / "trajectories_live.png", full_page=True)

        # The validation before training: the student's replies (greedy, not trained) scored by the teacher
        # token by token, beside the teacher's own (nothing to score).
        passes = urllib.parse.urlencode({"a": "0:student before", "b": "0:teacher"})
        page.goto(f"{training_server.url}/console/#/job/{job.id}/validation?{passes}")
        page.wait_for_selector("section.pair .side .tok")
        assert page.locator("#val-a option:checked").inner_text() == "step 0 · student before"
        assert page.locator("#val-b option:checked").inner_text() == "step 0 · teacher (teacher)"
        student_side, teacher_side = (
            page.locator("section.pair .side").nth(0),
            page.locator("section.pair .side").nth(1),
        )
        shades = student_side.locator(".tok").evaluate_all(
            "els => els.map(e => getComputedStyle(e).backgroundColor)"
        )
        assert shades and all(c.startswith(scale) for c in shades), shades[:5]
        assert "divergence" in student_side.inner_text() and teacher_side.locator(".tok").count() == 0
        page.screenshot(path=tmp_path / "validation_live.png", full_page=True)

        page.goto(f"{training_server.url}/console/#/job/{job.id}")
        page.wait_for_selector("button[data-act='cancel']")
        page.click("button[data-act='cancel']")
        page.wait_for_function(
            "['cancelled', 'succeeded', 'failed'].includes(document.getElementById('status').textContent)",
            timeout=300_000,
        )
        assert page.locator("#status").inner_text() == "cancelled"
        assert client.get_job(job.id).status == "cancelled"
    finally:
        cancel_unfinished(client, job.id)
