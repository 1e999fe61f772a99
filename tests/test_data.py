"""Prompt datasets: files, saved directories and hub ids through `datasets`; bad datasets fail early, a row with
media asyncrl does not train on included (videos, image URLs, images beside a plain-text prompt)."""

from __future__ import annotations

import asyncio
import itertools
import json
import pickle
from pathlib import Path

import pytest
from datasets import Dataset

from asyncrl.config import ConfigError
from asyncrl.config.compose import compose, to_config
from asyncrl.config.schema import Config
from asyncrl.data import (
    HEAD_ROWS,
    DatasetError,
    PromptStream,
    check_prompts,
    has_images,
    load_eval_prompts,
    load_prompts,
    load_train_prompts,
    most_images,
    standard_prompts,
)
from asyncrl.rewards import REWARDS
from asyncrl.rollout.scoring import RewardSource, score_group
from asyncrl.rollout.types import RolloutGroup
from asyncrl.trainer.setup import check_prompt_forms

SAMPLE = Path(__file__).parent / "assets" / "deepmath_sample.jsonl"


def test_deepmath_sample_loads_with_its_columns():
    dataset = load_prompts(str(SAMPLE))
    assert len(dataset) >= 20
    assert {"prompt", "solution"} <= set(dataset.column_names)
    assert dataset[0]["prompt"][0]["role"] == "user"


def test_parquet_and_saved_directory(tmp_path):
    rows = [json.loads(line) for line in SAMPLE.read_text().splitlines()]
    Dataset.from_list(rows).to_parquet(tmp_path / "d.parquet")
    assert len(load_prompts(str(tmp_path / "d.parquet"))) == len(rows)
    Dataset.from_list(rows).save_to_disk(tmp_path / "saved")
    assert len(load_prompts(str(tmp_path / "saved"))) == len(rows)


def test_extra_columns_reach_the_reward_and_gold_answers_score(tmp_path):
    """The deepmath path: rows -> group -> accuracy reward with `solution` (and the other columns) as kwargs."""
    dataset = load_prompts(str(SAMPLE))
    seen: dict[str, list] = {}

    def spy(prompts, completions, completion_ids, **columns):
        seen.update(columns)
        return [0.0] * len(completions)

    rows = [dataset[i] for i in range(6)]
    completions = [[{"role": "assistant", "content": f"so the answer is \\boxed{{{r['solution']}}}"}] for r in rows]
    group = RolloutGroup(
        prompts=[r["prompt"] for r in rows], reward_kwargs={k: [r[k] for r in rows] for k in rows[0] if k != "prompt"},
        completions=completions, completions_ids=[[1]] * 6, completions_sequences=[[]] * 6, tool_call_counts=[0] * 6,
        tool_failure_counts=[0] * 6, model_version=0, group_id=0, row_index=0, env_rewards=[None] * 6,
        rollout_rewards=[None] * 6,
    )  # fmt: skip
    per_source = asyncio.run(score_group(group, [RewardSource("accuracy", REWARDS.build("accuracy")),
                                                 RewardSource("spy", spy)]))  # fmt: skip
    assert set(seen) == set(dataset.column_names) - {"prompt"} | {"trainer_state", "log_metric", "log_extra"}
    parsable = [i for i, r in enumerate(rows) if r["solution"] not in ("", "?", "\\ldots", "\\text{}")]
    assert all(per_source["accuracy"][i] == 1.0 for i in parsable)


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"question": "1+1?", "solution": "2"}], "has no 'prompt' column (columns: question, solution)"),
        (
            [{"prompt": 7, "solution": "2"}],
            "'prompt' must be a list of {'role', 'content'} messages (conversational) or a string (standard), found "
            "int: '7'",
        ),
    ],
)
def test_bad_datasets_say_what_was_found(tmp_path, rows, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(DatasetError) as info:
        load_prompts(str(path))
    assert message in str(info.value)


def plain_file(tmp_path: Path) -> Path:
    path = tmp_path / "plain.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"What is {i}+{i}?", "solution": str(2 * i)}) for i in range(3)))
    return path


def test_standard_plain_text_prompts_load_and_take_no_tools(tmp_path):
    path = plain_file(tmp_path)
    dataset = load_prompts(str(path))
    assert standard_prompts(dataset) and not standard_prompts(load_prompts(str(SAMPLE)))
    config = to_config(compose([f"data.path={path}", "data.eval_path=null"]))
    assert check_prompt_forms(config, dataset, None) is False  # no chat template needed
    assert check_prompt_forms(config, dataset, load_prompts(str(SAMPLE))) is True
    config.rollout.tools = ["asyncrl.environments.counter:increment"]
    with pytest.raises(ConfigError, match=r"has standard \(plain-text\) prompts, which take no tools or environments"):
        check_prompt_forms(config, dataset, None)


def test_unsupported_file_type(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("prompt\nx\n")
    with pytest.raises(DatasetError, match="unsupported extension '.csv'"):
        load_prompts(str(path))


def test_a_missing_file_or_directory_names_the_key(tmp_path):
    with pytest.raises(DatasetError, match=r"^data.eval_path=.*missing.jsonl: no such file$"):
        load_prompts(str(tmp_path / "missing.jsonl"), key="data.eval_path")
    with pytest.raises(DatasetError, match=r"^data.path=.*nothing-here: Couldn't find any data file"):
        load_prompts(str(tmp_path / "nothing-here"))


def user(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


TEXT = {"type": "text", "text": "What is 1+1?"}


@pytest.mark.parametrize(
    ("rows", "message", "fix"),
    [
        ([{"prompt": user(TEXT)}, {"prompt": user(TEXT)}, {"prompt": user({"type": "video", "video": "a.mp4"}, TEXT)}],
         "row 2's prompt has a 'video' content part", "asyncrl trains on text and images"),
        ([{"prompt": user(TEXT)}, {"prompt": user({"image_url": "http://x/cat.png"})}],
         "row 1's prompt has a 'image_url' content part", "asyncrl trains on text and images"),
        ([{"prompt": "hi", "images": []}, {"prompt": "hi", "images": ["cat.png"]}],
         "row 1 has images in its 'images' column and a plain-text prompt", "give the prompt as a conversation"),
        ([{"prompt": "hi", "image": None}, {"prompt": "hi", "image": "cat.png"}],
         "row 1 has images in its 'image' column and a plain-text prompt", "give the prompt as a conversation"),
    ],
)  # fmt: skip
def test_a_row_with_media_asyncrl_does_not_train_on_is_refused_naming_it(rows, message, fix):
    with pytest.raises(DatasetError) as info:
        check_prompts(Dataset.from_list(rows), "vlm.jsonl")
    assert str(info.value).startswith(f"dataset vlm.jsonl: {message}: {fix}")
    assert "\n" not in str(info.value)


def test_images_in_a_column_or_in_image_parts_pass_and_are_counted():
    rows = [{"prompt": user(TEXT, TEXT), "images": []}, {"prompt": user(TEXT), "images": None}]
    check_prompts(Dataset.from_list(rows), "text.jsonl")
    assert most_images(Dataset.from_list(rows)) == 0 and not has_images(Dataset.from_list(rows))
    rows = [{"prompt": user(TEXT), "images": ["a.png", "b.png"]}, {"prompt": user(TEXT), "images": ["a.png"]}]
    check_prompts(Dataset.from_list(rows), "vlm.jsonl")
    assert most_images(Dataset.from_list(rows)) == 2
    parts = [{"prompt": user({"type": "image"}, {"type": "image"}, {"type": "image"}, TEXT), "image": None}]
    check_prompts(Dataset.from_list(parts), "vlm.jsonl")
    assert most_images(Dataset.from_list(parts)) == 3 and has_images(Dataset.from_list(parts))
    assert most_images(Dataset.from_list([{"prompt": user(TEXT), "image": "a.png"}])) == 1


def streamed(*overrides: str, path: Path = SAMPLE) -> Config:
    return to_config(compose([f"data.path={path}", "data.streaming=true", "trainer.max_steps=5", *overrides]))


def solutions(stream: PromptStream, start: int, count: int) -> list[tuple[int, int, str, int, bool]]:
    """(index, position, the row's solution, pass, ends its pass) of ``count`` prompts from the ``start``-th."""
    taken = itertools.islice(stream.prompts_from(start), count)
    return [(index, position, row["solution"], epoch, last) for index, position, row, epoch, last in taken]


def test_an_unshuffled_stream_gives_the_rows_of_the_whole_split_in_order_pass_after_pass(tmp_path):
    """TRL's IterableDataset: the same rows as the split loaded whole, never the split at once; the same from a saved
    directory (through to_iterable_dataset)."""
    whole = load_prompts(str(SAMPLE))
    n = len(whole)
    stream = load_train_prompts(streamed("data.shuffle=false"))
    assert isinstance(stream, PromptStream) and stream.column_names == whole.column_names
    rows = solutions(stream, 0, 2 * n + 3)
    assert [s for _, _, s, _, _ in rows] == (list(whole["solution"]) * 3)[: 2 * n + 3]
    assert [i for i, *_ in rows] == list(range(2 * n + 3))
    assert [(p, e, last) for _, p, _, e, last in rows[n - 1 : n + 1]] == [(n - 1, 0, True), (0, 1, False)]
    assert stream.rows_per_pass == n and not any(last for *_, last in rows[n + 1 : 2 * n - 1])
    whole.save_to_disk(tmp_path / "saved")
    saved = load_train_prompts(streamed("data.shuffle=false", path=tmp_path / "saved"))
    assert [s for _, _, s, _, _ in solutions(saved, 0, n)] == list(whole["solution"])


def test_a_shuffled_stream_reshuffles_each_pass_and_a_resume_skips_what_was_consumed():
    """Each pass is a seeded buffer shuffle of every row (seed + pass); resuming at prompt k (also in a later pass,
    and in a fresh copy, as the worker's unpickled one is) yields exactly the prompts from k of an uninterrupted
    run."""
    stream = load_train_prompts(streamed("data.shuffle_buffer_size=8"))
    n = len(load_prompts(str(SAMPLE)))
    run = solutions(stream, 0, 2 * n + 4)
    first, second = ([s for _, _, s, _, _ in run[p * n : (p + 1) * n]] for p in (0, 1))
    assert sorted(first) == sorted(second) == sorted(list(load_prompts(str(SAMPLE))["solution"]))
    assert first != second and first != list(load_prompts(str(SAMPLE))["solution"])
    for start in (0, 7, n, n + 5, 2 * n + 1):
        resumed = pickle.loads(pickle.dumps(load_train_prompts(streamed("data.shuffle_buffer_size=8"))))
        assert solutions(resumed, start, 3) == run[start : start + 3], start
    known = load_train_prompts(streamed("data.shuffle_buffer_size=8"))
    known.rows_per_pass = n  # learned: the passes before the resume's are skipped unread
    assert solutions(known, 2 * n + 1, 3) == run[2 * n + 1 : 2 * n + 4]


def test_streaming_needs_max_steps_and_refuses_what_needs_the_whole_split():
    with pytest.raises(ConfigError, match=r"^data.streaming=true: .* trainer.max_steps=-1 .*set trainer.max_steps=N$"):
        to_config(compose([f"data.path={SAMPLE}", "data.streaming=true", "trainer.max_steps=-1"]))
    with pytest.raises(ConfigError, match=r"^data.retire_solved_after=2 retires rows .*\(data.streaming=true\)"):
        streamed("data.retire_solved_after=2")
    with pytest.raises(ConfigError, match=r"^rollout.environment_factory maps names .*\(data.streaming=true\)"):
        streamed("+rollout.environment_factory={counter: asyncrl.environments.counter:CounterEnv}")
    with pytest.raises(ConfigError, match=r"^data.shuffle_buffer_size=0 must be >= 1$"):
        streamed("data.shuffle_buffer_size=0")
    with pytest.raises(DatasetError, match=r"is streamed \(data.streaming=true\): its 'prompt' column cannot be"):
        load_train_prompts(streamed())["prompt"]  # what measuring the longest prompt for vLLM's context reads
    assert isinstance(load_train_prompts(to_config(compose([f"data.path={SAMPLE}"]))), Dataset)


def test_a_streamed_split_is_checked_on_its_first_rows_and_each_row_as_it_is_read(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "1+1?"}) + "\n")
    with pytest.raises(DatasetError, match=r"has no 'prompt' column \(columns: question\)"):
        load_train_prompts(streamed(path=bad))
    late = tmp_path / "late.jsonl"
    rows = [{"prompt": user({"type": "text", "text": f"{i}+{i}?"}), "solution": str(i)} for i in range(HEAD_ROWS + 2)]
    rows[HEAD_ROWS + 1]["prompt"] = user({"type": "video", "text": "cat.mp4"})
    late.write_text("\n".join(json.dumps(r) for r in rows))
    stream = load_train_prompts(streamed("data.shuffle=false", path=late))
    assert not standard_prompts(stream) and standard_prompts(load_train_prompts(streamed(path=plain_file(tmp_path))))
    assert len(solutions(stream, 0, HEAD_ROWS + 1)) == HEAD_ROWS + 1
    with pytest.raises(
        DatasetError, match=rf"the row at position {HEAD_ROWS + 1} of pass 0 has a 'video' content part"
    ):
        solutions(stream, 0, HEAD_ROWS + 2)


def test_a_streamed_eval_split_reads_only_the_rows_evaluated():
    config = streamed(f"data.eval_path={SAMPLE}", "data.num_eval_prompts=4")
    evaluated = load_eval_prompts(config)
    assert isinstance(evaluated, Dataset)
    assert evaluated["solution"] == list(load_prompts(str(SAMPLE))["solution"])[:4]
    assert load_eval_prompts(streamed(f"data.eval_path={SAMPLE}", "data.num_eval_prompts=0")) is None
