"""Message helpers shared by reward functions, and the README's own-task walk-through: its data loads, its command
validates, its reward builds through the registry and scores."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from asyncrl.cli import app
from asyncrl.data import load_prompts
from asyncrl.registry import RegistryError
from asyncrl.rewards.base import REWARDS, final_answer_text, message_text

ROOT = Path(__file__).parents[2]


def test_final_answer_text_reads_the_last_assistant_message():
    completion = [
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "calc"}}]},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": r"\boxed{42}"},
        {"role": "tool", "content": "ignored"},
    ]
    assert final_answer_text(completion) == r"\boxed{42}"
    assert final_answer_text([{"role": "user", "content": "hi"}]) == ""


def test_built_in_rewards_score_a_standard_prompts_plain_text_completion():
    accuracy = REWARDS.build("accuracy")
    assert final_answer_text(r" so \boxed{4}") == r" so \boxed{4}"
    texts = [r" so \boxed{4}", r" \boxed{5}"]
    assert accuracy(["What is 2+2?"] * 2, texts, [[1], [1]], solution=["4", "4"]) == [1.0, 0.0]


def test_message_text_joins_text_parts():
    message = {
        "role": "assistant",
        "content": [{"type": "text", "text": "a "}, {"type": "image"}, {"type": "text", "text": "b"}],
    }
    assert message_text(message) == "a b"
    assert message_text({"role": "assistant", "content": None}) == ""


def test_builtins_are_registered():
    assert {"accuracy", "format"} <= set(REWARDS.names())


def _readme_train_arguments() -> list[str]:
    """The overrides of the README's `asyncrl train` command run in examples/own_task."""
    block = re.search(r"```bash\ncd examples/own_task\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert block is not None, "README.md: the own-task command is gone"
    words = shlex.split(block[1].replace("\\\n", " "))
    return words[words.index("train") + 1 :]


def test_the_readme_task_validates_and_its_reward_scores_through_the_registry(monkeypatch):
    task = ROOT / "examples" / "own_task"
    monkeypatch.chdir(task)
    monkeypatch.syspath_prepend(str(task))  # the README's PYTHONPATH=$PWD
    arguments = _readme_train_arguments()
    result = CliRunner().invoke(app, ["config", *arguments])
    assert result.exit_code == 0, result.output
    assert "path: train.jsonl" in result.output and "my_task.rewards:exact_answer" in result.output
    row = load_prompts("train.jsonl")[0]
    reward = REWARDS.build({"name": "my_task.rewards:exact_answer", "ignore_case": False})
    completions = [[{"role": "assistant", "content": text}] for text in (row["answer"], row["answer"].upper(), "no")]
    assert reward([row["prompt"]] * 3, completions, [[1]] * 3, answer=[row["answer"]] * 3) == [1.0, 0.0, 0.0]
    with pytest.raises(RegistryError, match="has no parameter 'ignore_cse' \\(has: answer, ignore_case\\)"):
        REWARDS.build({"name": "my_task.rewards:exact_answer", "ignore_cse": False})
