"""The math-verify accuracy reward on the DeepMath-schema sample, from the main thread, threads and a spawned worker."""

from __future__ import annotations

import json
import multiprocessing
import pickle
import threading
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import pytest

from asyncrl.rewards import REWARDS
from asyncrl.rewards.accuracy import accuracy

SAMPLE = Path(__file__).parents[1] / "assets" / "deepmath_sample.jsonl"
ROWS = [json.loads(line) for line in SAMPLE.read_text().splitlines()]

# gold -> (an equivalent answer written differently, a wrong answer)
ANSWERS = {
    "2": ("2.0", "3"),
    "391": ("391", "389"),
    "24": ("24", "12"),
    "5050": ("5,050", "5000"),
    "-5": ("x = -5", "5"),
    r"\frac{1}{6}": ("1/6", r"\frac{1}{36}"),
    r"\frac{3}{2}": ("1.5", r"\frac{2}{3}"),
    r"\dfrac{2}{5}": ("0.4", r"\frac{2}{7}"),
    r"3\sqrt{2}": (r"\sqrt{18}", "6"),
    r"2\sqrt{3}": (r"\sqrt{12}", r"3\sqrt{2}"),
    r"9\pi": (r"9 \pi", r"6\pi"),
    r"\frac{\pi}{4}": (r"\pi/4", r"\frac{\pi}{2}"),
    r"\frac{\sqrt{3}}{2}": (r"\frac{1}{2}\sqrt{3}", r"\frac{1}{2}"),
    "e^{2}": ("e^2", "2e"),
    r"\ln 4": (r"2\ln 2", r"\ln 2"),
    "x^2 + 2x + 1": ("1 + 2x + x^2", "x^2 + 1"),  # "(x+1)^2" copies "Expand $(x+1)^2$": restated, 0.0
    r"3x^2 \sin x + x^3 \cos x": (r"x^2(3\sin x + x\cos x)", r"3x^2 \cos x"),
    "(-1, 3)": (r"\left(-1, 3\right)", "[-1, 3]"),
    r"[2, \infty)": (r"[2,\infty)", r"(2, \infty)"),
    r"\{1, 2, 3\}": (r"\{3, 2, 1\}", r"\{1, 2\}"),
    "12": ("12.0", "1.2"),
    "1048576": ("1,048,576", "1048567"),  # "2^{20}" copies the question: restated, 0.0
    "120": (r"\binom{10}{3}", "720"),
    r"-\infty": (r"-\infty", r"\infty"),
}
UNPARSABLE_GOLD = {"", r"\ldots", "?", r"\text{}"}


def assistant(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


def score(rows: list[dict], texts: list[str], reward=accuracy) -> list[float | None]:
    """Call a reward as the worker does: every dataset column except prompt, one entry per completion."""
    columns = {key: [row[key] for row in rows] for key in rows[0] if key != "prompt"}
    prompts = [row["prompt"] for row in rows]
    return reward(
        prompts=prompts, completions=[assistant(t) for t in texts], completion_ids=[[0]] * len(rows), **columns
    )


def cases() -> tuple[list[dict], list[str], list[float | None]]:
    """Four completions per row: equivalent, the gold itself after a crossed-out guess, wrong, unboxed."""
    rows, texts, expected = [], [], []
    for row in ROWS:
        gold = row["solution"]
        right, wrong = ANSWERS.get(gold, ("1", "2"))
        parsable = gold not in UNPARSABLE_GOLD
        for text, reward in [
            (rf"Working it out carefully, the answer is $\boxed{{{right}}}$.", 1.0),
            (rf"A first guess was \boxed{{{wrong}}}, but on reflection it is \boxed{{{gold}}}.", 1.0),
            (rf"The answer is \boxed{{{wrong}}}.", 0.0),
            (f"The answer is {right}.", 0.0),
        ]:
            rows.append(row)
            texts.append(text)
            expected.append(reward if parsable else None)
    return rows, texts, expected


def test_sample_has_the_deepmath_schema_and_covers_every_row():
    assert len(ROWS) >= 24
    for row in ROWS:
        assert set(row) == {"prompt", "solution", "difficulty", "topic"}
        assert [message["role"] for message in row["prompt"]] == ["user"]
        assert isinstance(row["solution"], str) and isinstance(row["difficulty"], float)
        assert row["topic"].startswith("Mathematics -> ")
    golds = {row["solution"] for row in ROWS}
    assert golds == set(ANSWERS) | UNPARSABLE_GOLD and len(ANSWERS) >= 20


def test_scores_the_sample():
    rows, texts, expected = cases()
    assert score(rows, texts) == expected


def test_scores_the_same_from_worker_threads():
    rows, texts, expected = cases()
    chunks = [slice(start, start + 16) for start in range(0, len(rows), 16)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda part: score(rows[part], texts[part]), chunks))
    assert [reward for part in results for reward in part] == expected


def test_answers_in_the_last_assistant_message_and_in_text_parts():
    completion = [
        {"role": "assistant", "content": r"Let me check with the tool. \boxed{3}"},
        {"role": "tool", "content": "391"},
        {"role": "assistant", "content": [{"type": "text", "text": r"So it is \boxed{391}."}]},
    ]
    assert accuracy(prompts=[[]], completions=[completion], completion_ids=[[0]], solution=["391"]) == [1.0]


def test_missing_gold_is_not_applicable():
    rewards = accuracy(
        prompts=[[]] * 2, completions=[assistant(r"\boxed{1}")] * 2, completion_ids=[[0]] * 2, solution=[None, 1]
    )
    assert rewards == [None, 1.0]


def test_pickles_with_bound_parameters():
    reward = pickle.loads(pickle.dumps(REWARDS.build({"name": "accuracy", "timeout_s": 2})))
    assert score(ROWS[:2], [r"\boxed{2}", r"\boxed{390}"], reward=reward) == [1.0, 0.0]


def test_runs_in_a_spawned_worker_process():
    rows, texts, expected = cases()
    columns = {key: [row[key] for row in rows] for key in rows[0] if key != "prompt"}
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        future = pool.submit(
            accuracy,
            prompts=[row["prompt"] for row in rows],
            completions=[assistant(t) for t in texts],
            completion_ids=[[0]] * len(rows),
            **columns,
        )
        assert future.result(timeout=120) == expected


@pytest.mark.parametrize("in_thread", [False, True])
def test_a_pathological_answer_scores_zero_quickly(in_thread):
    result: dict[str, list] = {}

    def run() -> None:
        result["rewards"] = score(
            ROWS[:1], [r"\boxed{9^{9^{9^{9}}}}"], reward=REWARDS.build({"name": "accuracy", "timeout_s": 1})
        )

    thread = threading.Thread(target=run) if in_thread else None
    if thread:
        thread.start()
        thread.join(timeout=30)
    else:
        run()
    assert result["rewards"] == [0.0]


def test_an_answer_copied_from_the_prompt_scores_nothing_unless_allowed():
    """SmolLM2-135M learned ``\\boxed{36 - 25}`` for "What is 36 - 25?" (math-verify evaluates it to the gold)."""
    prompt = [{"role": "user", "content": r"What is 36 - 25? Put your final answer within \boxed{}."}]
    texts = [r"\boxed{36 - 25}", r"\boxed{36-25}", r"\boxed{11}", r"\boxed{25 + 11 - 25}", r"\boxed{12}"]
    common = dict(prompts=[prompt] * 5, completions=[assistant(t) for t in texts], completion_ids=[[0]] * 5)
    assert accuracy(**common, solution=["11"] * 5) == [0.0, 0.0, 1.0, 1.0, 0.0]
    assert accuracy(**common, solution=["11"] * 5, reject_restated=False) == [1.0, 1.0, 1.0, 1.0, 0.0]
    options = REWARDS.build({"name": "accuracy", "reject_restated": False})
    assert options(**common, solution=["11"] * 5) == [1.0, 1.0, 1.0, 1.0, 0.0]


def test_a_right_number_or_the_gold_itself_found_in_the_prompt_still_counts():
    prompt = "What is 5 * 1? Then write x^2 + 1 as given."
    rewards = accuracy([prompt] * 2, [r"\boxed{5}", r"\boxed{x^2 + 1}"], [[0]] * 2, solution=["5", "x^2 + 1"])
    assert rewards == [1.0, 1.0]
