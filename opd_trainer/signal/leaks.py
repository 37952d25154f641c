"""The leakage check: a trained reply that carries a hindsight note's own wording (`LEAK_WORDS` words in
a row of its fixed header) or hindsight wording (`HINDSIGHT_PHRASES`: talk of the final result or
outcome, of what "turned out", of a failure the turn could not have seen; English and Chinese) learned
the note, not the task. The signal drops such a rollout from the step's training (`drop_leaks`,
`hindsight/leaked_rollouts` per step) and the beacons drop such a rewrite (`beacons/leaked`). The list
is phrases, not the bare "成功" / "失败" / "应该" (success, failure, should): an agent's ordinary reply
says "已成功更新" or "the call failed" after reading an error, which is what the context shows, not
hindsight; only the compounds that speak of the outcome are flagged.
"""

from __future__ import annotations

import re

from opd_trainer.records import LLMCall
from opd_trainer.signal.notes import BEACON_HEADER, NOTE_HEADER
from opd_trainer.signal.shaped import Shaped
from opd_trainer.stats import mean

# A trained reply that carries the notes' own wording learned the note, not the task: any run of this
# many words of the notes' header, case and punctuation aside. The header only: what follows it ("a
# correct final answer to this task is ...") is wording a reply may use by itself.
LEAK_WORDS = 4


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


NOTE_RUNS = frozenset(
    tuple(words[i : i + LEAK_WORDS])
    for words in (_words(NOTE_HEADER), _words(BEACON_HEADER))
    for i in range(len(words) - LEAK_WORDS + 1)
)


# Hindsight wording (a beacon template's "最终结果证明该动作导致后续查询失败", and a scan for "最终结果" /
# "成功" / "失败"), as phrases a reply written without hindsight has no reason to use;
# English ones match whole words (case, spacing and apostrophes aside), Chinese ones as written.
HINDSIGHT_PHRASES: tuple[str, ...] = (
    "in hindsight",
    "with hindsight",
    "benefit of hindsight",
    "hindsight shows",
    "the final result",
    "the final results",
    "the final outcome",
    "the outcome shows",
    "the outcome showed",
    "according to the final",
    "turned out",
    "the episode failed",
    "the episode succeeded",
    "the task failed",
    "led to failure",
    "leads to failure",
    "ended in failure",
    "eventually failed",
    "an earlier attempt",
    "the reference expects",
    "the reference expected",
)
HINDSIGHT_PHRASES_ZH: tuple[str, ...] = (
    "最终结果",
    "事后",
    "结果证明",
    "事实证明",
    "最终证明",
    "后来证明",
    "根据最终",
    "最终成功",
    "最终失败",
    "最后成功",
    "最后失败",
    "任务成功",
    "任务失败",
    "导致后续",
)
# And the template's "导致后续查询失败": what an action led to, a few characters on.
LED_TO = r"导致[^。！？!?\n]{0,12}(?:成功|失败)"
_HINDSIGHT = re.compile(
    "|".join(
        [rf"\b{re.escape(p)}\b" for p in HINDSIGHT_PHRASES]
        + [re.escape(p) for p in HINDSIGHT_PHRASES_ZH]
        + [LED_TO]
    )
)


def hindsight_wording(text: str) -> str | None:
    """The first of the hindsight phrases (`HINDSIGHT_PHRASES`, `HINDSIGHT_PHRASES_ZH`) in
    `text`, None when it has none."""
    plain = re.sub(r"\s+", " ", text.lower().replace("\u2019", "'"))
    found = _HINDSIGHT.search(plain)
    return found.group(0) if found else None


def carries_note_wording(text: str) -> bool:
    """`text` holds `LEAK_WORDS` consecutive words of the hindsight notes' or beacons' header (not of
    what a note reports: a reply may well state the reference answer, never "hindsight for scoring ..."),
    or one of the hindsight phrases (`hindsight_wording`)."""
    words = _words(text)
    if any(tuple(words[i : i + LEAK_WORDS]) in NOTE_RUNS for i in range(len(words) - LEAK_WORDS + 1)):
        return True
    return hindsight_wording(text) is not None


def drop_leaks(segments: list[LLMCall]) -> Shaped:
    """`segments` less every rollout one of whose trained replies carries a note's wording. Metrics:
    `hindsight/teacher_note_share` (of `segments`, those the teacher scored with a note) and
    `hindsight/leaked_rollouts` (the rollouts dropped)."""
    leaked = {s.rollout_id for s in segments if carries_note_wording(s.text)}
    metrics = {
        "hindsight/teacher_note_share": mean([s.teacher_saw_note for s in segments]),
        "hindsight/leaked_rollouts": float(len(leaked)),
    }
    return Shaped([s for s in segments if s.rollout_id not in leaked], metrics)
