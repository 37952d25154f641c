"""Loading user processor classes from workspaces: both classpath forms, every error, isolation."""

from __future__ import annotations

import asyncio
import pickle
import sys
import textwrap
import types
from pathlib import Path

import pytest

from opd_trainer.errors import OPDError, ProcessorLoadError
from opd_trainer.sdk import AbstractRewardProcessor, AbstractRolloutProcessor, call_processor
from opd_trainer.workers.classpath import instantiate_processor, load_processor_class, validate_workspace

ROLLOUT = """
from opd_trainer.sdk import AbstractRolloutProcessor, AgentOutput, RolloutOutput

class MyRollout(AbstractRolloutProcessor):
    label = "{label}"

    async def process(self, rollout_input):
        return RolloutOutput(agent_output=AgentOutput(messages=[]))
"""

REWARD = """
from opd_trainer.sdk import AbstractRewardProcessor, Reward, RewardOutput

class MyReward(AbstractRewardProcessor):
    def process(self, reward_input):
        return RewardOutput(reward=Reward(reward_score=1.0))
"""


def make_workspace(root: Path, files: dict[str, str]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def standard(root: Path, label: str = "a") -> Path:
    return make_workspace(
        root,
        {
            "functions/__init__.py": "",
            "functions/rollout.py": ROLLOUT.format(label=label),
            "functions/reward.py": REWARD,
            "requirements.txt": "",
        },
    )


def load_error(
    workspace: Path, classpath: str, kind: str = "rollout", **kwargs: object
) -> ProcessorLoadError:
    with pytest.raises(ProcessorLoadError) as info:
        load_processor_class(workspace, classpath, kind, **kwargs)  # type: ignore[arg-type]
    return info.value


@pytest.fixture(autouse=True)
def _no_leaks():
    path, modules = list(sys.path), set(sys.modules)
    yield
    assert sys.path == path
    leaked = {m for m in set(sys.modules) - modules if m.split(".")[0] in {"functions", "rollout", "shared"}}
    assert not leaked


def test_dotted_classpath_loads(tmp_path: Path) -> None:
    cls = load_processor_class(standard(tmp_path), "functions.rollout.MyRollout", "rollout")
    assert issubclass(cls, AbstractRolloutProcessor) and cls.__name__ == "MyRollout"
    reward = load_processor_class(tmp_path, "functions.reward.MyReward", "reward", component="judge")
    assert issubclass(reward, AbstractRewardProcessor)


def test_file_classpath_loads_inside_and_outside_packages(tmp_path: Path) -> None:
    workspace = standard(tmp_path)
    make_workspace(
        workspace,
        {
            "functions/relative.py": "from .rollout import MyRollout as Relative\n",
            "scripts/loose.py": ROLLOUT.format(label="loose"),
        },
    )
    in_package = load_processor_class(workspace, "functions/rollout.py:MyRollout", "rollout")
    assert in_package.__module__ == "functions.rollout"
    relative = load_processor_class(workspace, "functions/relative.py:Relative", "rollout")
    assert relative.__name__ == "MyRollout"
    loose = load_processor_class(workspace, "scripts/loose.py:MyRollout", "rollout")
    assert loose.label == "loose"


def test_absolute_imports_between_workspace_modules(tmp_path: Path) -> None:
    workspace = make_workspace(
        tmp_path,
        {
            "functions/__init__.py": "",
            "functions/rollout.py": "from shared.base import Base\nclass MyRollout(Base):\n    pass\n",
            "shared/__init__.py": "",
            "shared/base.py": ROLLOUT.format(label="shared").replace("MyRollout", "Base"),
        },
    )
    cls = load_processor_class(workspace, "functions.rollout.MyRollout", "rollout")
    assert cls.label == "shared"


def test_two_workspaces_with_functions_packages_side_by_side(tmp_path: Path) -> None:
    first = load_processor_class(standard(tmp_path / "a", "a"), "functions.rollout.MyRollout", "rollout")
    second = load_processor_class(standard(tmp_path / "b", "b"), "functions.rollout.MyRollout", "rollout")
    assert (first.label, second.label) == ("a", "b")
    assert first is not second
    again = load_processor_class(tmp_path / "a", "functions.rollout.MyRollout", "rollout")
    assert again.label == "a"
    for cls in (first, second):
        output = asyncio.run(call_processor(instantiate_processor(cls), object()))
        assert output.agent_output is not None


class _LazyModule(types.ModuleType):
    """Like transformers' lazy modules: a missing attribute is imported on lookup, and may fail."""

    def __getattr__(self, name: str) -> object:
        raise ModuleNotFoundError(f"looking up {name} imports an optional dependency", name="torchvision")


def test_lazy_modules_already_imported_are_not_touched(tmp_path: Path) -> None:
    sys.modules["opd_test_lazy"] = _LazyModule("opd_test_lazy")  # no __file__, no __path__
    try:
        cls = load_processor_class(standard(tmp_path), "functions.rollout.MyRollout", "rollout")
        assert cls.label == "a"
    finally:
        del sys.modules["opd_test_lazy"]


def test_existing_module_of_the_same_name_is_set_aside_and_restored(tmp_path: Path) -> None:
    impostor = types.ModuleType("functions")
    sys.modules["functions"] = impostor
    try:
        cls = load_processor_class(standard(tmp_path), "functions.rollout.MyRollout", "rollout")
        assert cls.label == "a"
        assert sys.modules["functions"] is impostor
    finally:
        del sys.modules["functions"]


def test_isolate_false_keeps_modules_for_lazy_imports(tmp_path: Path) -> None:
    workspace = standard(tmp_path)
    try:
        load_processor_class(workspace, "functions.rollout.MyRollout", "rollout", isolate=False)
        assert "functions.rollout" in sys.modules
        assert str(workspace.resolve()) in sys.path
    finally:
        for name in [m for m in sys.modules if m.split(".")[0] == "functions"]:
            del sys.modules[name]
        sys.path.remove(str(workspace.resolve()))


def test_missing_workspace(tmp_path: Path) -> None:
    error = load_error(tmp_path / "nope", "functions.rollout.MyRollout", component="agent")
    assert error.field == "functions.agent.fcmodel"
    assert "'functions.rollout.MyRollout'" in error.message and "does not exist" in error.message
    (tmp_path / "file").write_text("")
    error = load_error(tmp_path / "file", "functions.rollout.MyRollout")
    assert "is not a directory" in error.message


def test_package_folder_without_init(tmp_path: Path) -> None:
    workspace = make_workspace(tmp_path, {"functions/rollout.py": ROLLOUT.format(label="x")})
    error = load_error(workspace, "functions.rollout.MyRollout", component="agent")
    assert error.field == "functions.agent.fcmodel.classpath"
    assert "'functions.rollout.MyRollout'" in error.message
    assert "folder functions/ has no __init__.py" in error.message


def test_module_not_found(tmp_path: Path) -> None:
    error = load_error(standard(tmp_path), "functions.nothere.MyRollout", component="agent")
    assert error.field == "functions.agent.fcmodel.classpath"
    assert "'functions.nothere.MyRollout'" in error.message
    assert "module functions.nothere not found" in error.message
    error = load_error(tmp_path, "elsewhere.rollout.MyRollout")
    assert error.field == "fcmodel.classpath"
    assert "module elsewhere.rollout not found" in error.message and "'elsewhere'" in error.message


def test_file_not_found(tmp_path: Path) -> None:
    error = load_error(standard(tmp_path), "functions/nothere.py:MyRollout", component="agent")
    assert error.field == "functions.agent.fcmodel.classpath"
    assert "'functions/nothere.py:MyRollout'" in error.message
    assert "file functions/nothere.py not found" in error.message


@pytest.mark.parametrize("classpath", ["MyRollout", "functions/rollout:MyRollout", "a..b", "../x.py:C"])
def test_malformed_classpath(tmp_path: Path, classpath: str) -> None:
    error = load_error(standard(tmp_path), classpath)
    assert repr(classpath) in error.message


def test_class_not_found_lists_candidates(tmp_path: Path) -> None:
    error = load_error(standard(tmp_path), "functions.rollout.MyRolout", component="agent")
    assert error.field == "functions.agent.fcmodel.classpath"
    assert "'functions.rollout.MyRolout'" in error.message
    assert "class MyRolout not found in module functions.rollout" in error.message
    assert "rollout processor classes there: MyRollout" in error.message


def test_not_a_class(tmp_path: Path) -> None:
    workspace = standard(tmp_path)
    make_workspace(workspace, {"functions/plain.py": "def process(x):\n    return x\n"})
    error = load_error(workspace, "functions.plain.process")
    assert "process is a function, not a class" in error.message
    assert "opd_trainer.sdk.AbstractRolloutProcessor" in error.message
    assert "async def process(task, model, auxiliary_models)` workflow function" in error.message


def test_wrong_base_class(tmp_path: Path) -> None:
    workspace = standard(tmp_path)
    make_workspace(workspace, {"functions/plain.py": "class Plain:\n    pass\n"})
    error = load_error(workspace, "functions.plain.Plain", "reward", component="judge")
    assert error.field == "functions.judge.fcmodel.classpath"
    assert "class Plain is not a subclass of opd_trainer.sdk.AbstractRewardProcessor" in error.message
    error = load_error(workspace, "functions.reward.MyReward", "rollout")
    assert (
        "not a subclass of opd_trainer.sdk.AbstractRolloutProcessor (it is a reward processor)"
        in error.message
    )


def test_abstract_class(tmp_path: Path) -> None:
    workspace = standard(tmp_path)
    make_workspace(
        workspace,
        {
            "functions/half.py": (
                "from opd_trainer.sdk import AbstractRolloutProcessor\n"
                "class Half(AbstractRolloutProcessor):\n    pass\n"
            )
        },
    )
    error = load_error(workspace, "functions.half.Half")
    assert "class Half is abstract: implement process" in error.message


def test_import_error_carries_user_traceback(tmp_path: Path) -> None:
    workspace = standard(tmp_path)
    make_workspace(
        workspace,
        {
            "functions/broken.py": (
                "from functions.helpers import read_config\nCONFIG = read_config()\nclass Broken:\n    pass\n"
            ),
            "functions/helpers.py": "def read_config():\n    raise ValueError('bad config value')\n",
        },
    )
    error = load_error(workspace, "functions.broken.Broken", component="agent")
    assert error.field == "functions.agent.fcmodel.classpath"
    assert "'functions.broken.Broken'" in error.message and "raised ValueError" in error.message
    assert f'File "{workspace.resolve() / "functions" / "broken.py"}", line 2, in <module>' in error.message
    assert "CONFIG = read_config()" in error.message
    assert 'helpers.py", line 2, in read_config' in error.message
    assert "ValueError: bad config value" in error.message
    assert "importlib" not in error.message  # only frames inside the workspace


def test_missing_dependency_and_syntax_error(tmp_path: Path) -> None:
    workspace = standard(tmp_path)
    make_workspace(
        workspace,
        {
            "functions/needs.py": "import not_a_real_dependency_xyz\n",
            "functions/typo.py": "class Typo(:\n    pass\n",
        },
    )
    error = load_error(workspace, "functions.needs.Needs")
    assert "requirements.txt" in error.message
    assert "import not_a_real_dependency_xyz" in error.message
    assert "No module named 'not_a_real_dependency_xyz'" in error.message
    error = load_error(workspace, "functions/typo.py:Typo")
    assert "raised SyntaxError" in error.message and "typo.py" in error.message


def test_instantiate_runs_setup(tmp_path: Path) -> None:
    workspace = standard(tmp_path)
    make_workspace(
        workspace,
        {
            "functions/setup_ok.py": ROLLOUT.format(label="s")
            + "\n    def setup(self):\n        self.ready = True\n",
            "functions/setup_async.py": ROLLOUT.format(label="s")
            + "\n    async def setup(self):\n        self.ready = True\n",
        },
    )
    processor = instantiate_processor(
        load_processor_class(workspace, "functions.setup_ok.MyRollout", "rollout")
    )
    assert processor.ready is True
    processor = instantiate_processor(
        load_processor_class(workspace, "functions.setup_async.MyRollout", "rollout")
    )
    assert processor.ready is True


def test_instantiate_wraps_constructor_and_setup_errors(tmp_path: Path) -> None:
    workspace = standard(tmp_path)
    make_workspace(
        workspace,
        {
            "functions/bad_init.py": ROLLOUT.format(label="s")
            + "\n    def __init__(self, needed):\n        pass\n",
            "functions/bad_setup.py": ROLLOUT.format(label="s")
            + "\n    def setup(self):\n        raise RuntimeError('no tools')\n",
        },
    )
    cls = load_processor_class(workspace, "functions.bad_init.MyRollout", "rollout", component="agent")
    with pytest.raises(ProcessorLoadError) as info:
        instantiate_processor(cls)
    assert info.value.field == "functions.agent.fcmodel.classpath"
    assert "constructing 'functions.bad_init.MyRollout' raised TypeError" in info.value.message

    cls = load_processor_class(workspace, "functions/bad_setup.py:MyRollout", "rollout")
    with pytest.raises(ProcessorLoadError) as info:
        instantiate_processor(cls, component="agent")
    message = info.value.message
    assert info.value.field == "functions.agent.fcmodel.classpath"
    assert "setup() of 'functions/bad_setup.py:MyRollout' raised RuntimeError" in message
    assert "raise RuntimeError('no tools')" in message and "RuntimeError: no tools" in message
    assert "classpath.py" not in message


def test_processor_load_error_pickles() -> None:
    error = ProcessorLoadError("cannot load classpath 'a.B': boom", field="functions.agent.fcmodel.classpath")
    restored = pickle.loads(pickle.dumps(error))
    assert type(restored) is ProcessorLoadError and isinstance(restored, OPDError)
    assert (restored.message, restored.field) == (error.message, error.field)
    assert str(restored) == "functions.agent.fcmodel.classpath: cannot load classpath 'a.B': boom"


def test_validate_workspace(tmp_path: Path) -> None:
    workspace = standard(tmp_path)
    assert validate_workspace(workspace, "functions.rollout.MyRollout") == []
    make_workspace(workspace, {"tools/search.py": "", "functions/deep/x.py": ""})
    problems = validate_workspace(workspace, "functions.missing.MyRollout")
    assert any(p.startswith("folder tools/ holds .py files") for p in problems)
    assert any(p.startswith("folder functions/deep/ holds .py files") for p in problems)
    assert any("module functions.missing not found" in p for p in problems)
    assert validate_workspace(tmp_path / "nope") == [f"workspace {tmp_path / 'nope'} does not exist"]


def test_a_missing_package_is_named_on_the_first_line(tmp_path: Path) -> None:
    workspace = standard(tmp_path)
    make_workspace(
        workspace, {"functions/needs.py": "import not_a_real_package_xyz\nclass Needs:\n    pass\n"}
    )
    error = load_error(workspace, "functions.needs.Needs", component="agent")
    first_line = error.message.splitlines()[0]
    assert error.field == "functions.agent.fcmodel.classpath"
    assert (
        "'functions.needs.Needs'" in first_line
        and "'not_a_real_package_xyz', which is not installed" in first_line
    )
    assert "requirements.txt" in first_line


BEACON = """
from opd_trainer.sdk import AbstractBeaconProcessor, Beacon, BeaconOutput

class MyBeacon(AbstractBeaconProcessor):
    def process(self, beacon_input):
        return {"beacons": [{"turn": t.turn, "feedback": "look it up"} for t in beacon_input.turns]}

async def beacons(task, response, auxiliary_models):
    return None
"""


def test_a_beacon_component_loads_its_class_and_its_dict_answer_is_validated(tmp_path: Path) -> None:
    from opd_trainer.sdk import AgentOutput, BeaconInput, BeaconOutput, BeaconTurn

    workspace = make_workspace(tmp_path, {"coach/__init__.py": "", "coach/beacon.py": BEACON})
    cls = load_processor_class(workspace, "coach.beacon.MyBeacon", "beacon", component="coach")
    turn = BeaconTurn(turn=2, messages=[], reply={"role": "assistant", "content": "x"})
    payload = BeaconInput(agent_output=AgentOutput(messages=[]), reward=0.0, turns=[turn])
    output = asyncio.run(call_processor(instantiate_processor(cls), payload))
    assert isinstance(output, BeaconOutput) and [(b.turn, b.feedback) for b in output.beacons] == [
        (2, "look it up")
    ]
    # A function is a workflow or judge elsewhere; a beacon component is a class only.
    error = load_error(workspace, "coach.beacon.beacons", "beacon", component="coach")
    assert "is a function, not a class: name a subclass of" in error.message
    assert "AbstractBeaconProcessor" in error.message and error.field == "functions.coach.fcmodel.classpath"
    # A reward class named as a beacon says what it is.
    reward = make_workspace(tmp_path / "r", {"functions/__init__.py": "", "functions/reward.py": REWARD})
    wrong = load_error(reward, "functions.reward.MyReward", "beacon")
    assert "not a subclass of opd_trainer.sdk.AbstractBeaconProcessor (it is a reward processor)" in (
        wrong.message
    )
