"""A vision-language run through the real CLI on CPU: rows with an ``image`` column (file paths beside the data
file) train the tiny Qwen3.5 vision-language checkpoint through the built-in server, which renders each prompt with
its image; the trainer's rows carry the images' patches, the reward functions see the images, the held-out
evaluation sends them too. A text-only checkpoint given images is one line before anything starts.

A few steps only: this checks the plumbing; learning an image task is a recipe's run.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from PIL import Image, ImageDraw

from asyncrl.assets.tiny_vlm import save_tiny_vlm
from asyncrl.metrics import read_jsonl
from asyncrl.serving.process import free_port

from .helpers import run_cli, wait_no_marked

pytestmark = pytest.mark.e2e

STEPS = 2


def squares_data(folder: Path, rows: int = 24) -> Path:
    """``How many squares?`` over images of 1-4 black squares, each image a PNG beside the data file."""
    rng = random.Random(0)
    lines = []
    for index in range(rows):
        count = rng.randint(1, 4)
        image = Image.new("RGB", (48, 40), "white")
        draw = ImageDraw.Draw(image)
        for k in range(count):
            draw.rectangle([3 + 11 * k, 8, 10 + 11 * k, 15 + rng.randint(0, 12)], fill="black")
        image.save(folder / f"{index}.png")
        prompt = [{"role": "user", "content": "How many squares?"}]
        lines.append(json.dumps({"prompt": prompt, "image": f"{index}.png", "solution": str(count)}))
    (folder / "train.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "train.jsonl"


def test_an_image_dataset_trains_a_vision_language_checkpoint(tmp_path):
    model, data, run_dir = save_tiny_vlm(tmp_path / "vlm"), squares_data(tmp_path), tmp_path / "run"
    rewards = "reward_funcs=[{name: length, scale: 0.1}, {name: 'tests.e2e.rewards:image_reward'}]"
    run = run_cli(["train", f"model.name_or_path={model}", f"data.path={data}", f"data.eval_path={data}",
                   "data.num_eval_prompts=8", rewards, f"trainer.max_steps={STEPS}", f"trainer.save_steps={STEPS}",
                   "trainer.samples_per_step=16", "sampling.max_completion_length=8", "server=builtin",
                   f"server.port={free_port()}", "logging.console=plain", "logging.report=false",
                   "logging.log_completions=true", "logging.num_completions_to_print=2",
                   f"hydra.run.dir={run_dir}"], timeout_s=300)  # fmt: skip
    assert run.returncode == 0, run.output[-3000:]
    steps = read_jsonl(run_dir / "metrics.jsonl")
    assert [s["step"] for s in steps if "batch/samples_per_step" in s] == list(range(1, STEPS + 1))

    def logged(key: str) -> list[float]:
        return [s[key] for s in steps if s.get(key) is not None and not math.isnan(s[key])]

    assert logged("batch/images_per_step") and min(logged("batch/images_per_step")) >= 1  # patches reached the rows
    assert logged("rewards/image_reward/mean") and min(logged("rewards/image_reward/mean")) == 1.0
    evaluation = json.loads((run_dir / "eval.json").read_text())
    assert evaluation["before"]["eval/greedy_reward"] > 0  # the held-out prompts' images went to the server too
    assert (run_dir / "model" / "model.safetensors").is_file()
    assert "<image>How many squares?" in run.output and "1 image" in run.output  # the completions table
    assert wait_no_marked(run.marker) == []


def test_a_text_only_checkpoint_given_images_is_one_line(tmp_path):
    data = squares_data(tmp_path, rows=4)
    run = run_cli(["train", f"data.path={data}", "reward=length", "trainer.max_steps=1", "server=builtin",
                   f"server.port={free_port()}", f"hydra.run.dir={tmp_path / 'run'}"], timeout_s=180)  # fmt: skip
    assert run.returncode == 2, run.output[-2000:]
    lines = [line for line in run.output.splitlines() if line.startswith("config error")]
    assert len(lines) == 1 and "has images, and model.name_or_path=" in lines[0] and "text-only" in lines[0]
    assert "Traceback" not in run.output
