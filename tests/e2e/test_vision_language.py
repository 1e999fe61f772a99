"""Images given to a text-only checkpoint through the real CLI: one line before anything starts. A vision-language
run through the CLI is the shapes recipe's test (test_shapes_recipe.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from PIL import Image, ImageDraw

from asyncrl.serving.process import free_port

from .helpers import run_cli

pytestmark = pytest.mark.e2e


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


def test_a_text_only_checkpoint_given_images_is_one_line(tmp_path):
    data = squares_data(tmp_path, rows=4)
    run = run_cli(["train", f"data.path={data}", "reward=length", "trainer.max_steps=1", "server=builtin",
                   f"server.port={free_port()}", f"hydra.run.dir={tmp_path / 'run'}"], timeout_s=180)  # fmt: skip
    assert run.returncode == 2, run.output[-2000:]
    lines = [line for line in run.output.splitlines() if line.startswith("config error")]
    assert len(lines) == 1 and "has images, and model.name_or_path=" in lines[0] and "text-only" in lines[0]
    assert "Traceback" not in run.output
