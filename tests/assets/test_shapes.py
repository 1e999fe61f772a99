"""The shapes task (asyncrl/assets/shapes.py), its shipped splits, and the pretraining that writes tiny-vlm
(asyncrl/assets/pretrain_vlm.py) run for a few steps."""

from __future__ import annotations

import io
import json
import random
from collections import Counter

import pytest
from PIL import Image

from asyncrl.assets import asset_path
from asyncrl.assets.pretrain_vlm import main, noisy_count
from asyncrl.assets.shapes import (
    CELL,
    GRID,
    IMAGE_SIZE,
    MAX_COUNT,
    QUESTION,
    build_splits,
    read_rows,
    split_layouts,
    write_splits,
)
from asyncrl.data import load_prompts
from asyncrl.rollout.images import data_folder, row_images

WHITE = (255, 255, 255)


def squares_seen(png: bytes) -> int:
    """The filled squares a reader of the PNG sees: one per cell with any non-white pixel, each such cell's non-white
    pixels one colour filling their bounding box exactly (a square)."""
    image = Image.open(io.BytesIO(png)).convert("RGB")
    assert image.size == (IMAGE_SIZE, IMAGE_SIZE)
    found = 0
    for cell in range(GRID * GRID):
        left, top = (cell % GRID) * CELL, (cell // GRID) * CELL
        inked = {(x, y): image.getpixel((x, y)) for x in range(left, left + CELL) for y in range(top, top + CELL)
                 if image.getpixel((x, y)) != WHITE}  # fmt: skip
        if not inked:
            continue
        xs, ys = {x for x, _ in inked}, {y for _, y in inked}
        assert len(xs) == len(ys) == len(inked) ** 0.5 and max(xs) - min(xs) == len(xs) - 1, f"cell {cell}: no square"
        assert len(set(inked.values())) == 1
        found += 1
    return found


def test_splits_are_fixed_by_seed():
    assert build_splits(seed=3, n_train=20, n_eval=8) == build_splits(seed=3, n_train=20, n_eval=8)
    assert build_splits(seed=3, n_train=20, n_eval=8) != build_splits(seed=4, n_train=20, n_eval=8)


def test_eval_images_are_held_out_of_train():
    splits = build_splits(seed=0, n_train=2000, n_eval=200)
    train, held_out = ({row["image"] for row in rows} for rows in (splits["train"], splits["eval"]))
    assert len(train) == 2000 and len(held_out) == 200  # distinct images within each split too
    assert not train & held_out


def test_answers_are_the_squares_drawn_and_counts_are_balanced():
    splits = build_splits(seed=1, n_train=80, n_eval=40)
    for rows in splits.values():
        for row in rows:
            assert row["prompt"] == [{"role": "user", "content": QUESTION}]
            assert row["solution"] == str(squares_seen(row["image"]))
        assert Counter(row["solution"] for row in rows) == {str(n): len(rows) // MAX_COUNT for n in range(1, 5)}


@pytest.mark.parametrize(("n_train", "n_eval"), [(0, 10), (10, 0)])
def test_empty_splits_name_the_argument(n_train, n_eval):
    with pytest.raises(ValueError, match="n_train=.*n_eval="):
        split_layouts(seed=0, n_train=n_train, n_eval=n_eval)


def test_written_splits_load_as_image_rows(tmp_path):
    paths = write_splits(tmp_path / "shapes", seed=2, n_train=12, n_eval=4)
    assert {split: read_rows(path) for split, path in paths.items()} == build_splits(seed=2, n_train=12, n_eval=4)
    dataset = load_prompts(str(paths["train"]))
    [image] = row_images(dataset[0], data_folder(str(paths["train"])))
    assert image.size == (IMAGE_SIZE, IMAGE_SIZE) and image.mode == "RGB"


def test_shipped_splits_are_the_generator_output():
    shipped = {split: read_rows(asset_path("shapes") / f"{split}.parquet") for split in ("train", "eval")}
    assert shipped == build_splits(seed=0, n_train=2000, n_eval=200)


def test_noisy_count_is_right_at_the_asked_rate_else_off_by_one():
    rng = random.Random(0)
    answers = [noisy_count(3, rng, p_correct=0.4) for _ in range(4000)]
    assert set(answers) == {2, 3, 4}
    assert answers.count(3) / len(answers) == pytest.approx(0.4, abs=0.03)


TINY_RUN = ["--steps", "2", "--batch-size", "4", "--warmup-steps", "1", "--clean-steps", "1", "--log-every", "2"]
TINY_RUN += ["--n-train", "8", "--n-eval", "4", "--n-pool", "16", "--eval-samples", "2"]


@pytest.fixture(scope="module")
def pretrained(run_twice):
    """The same few-step pretraining twice, to compare what each wrote."""
    return run_twice(main, "tiny-vlm", TINY_RUN)


def test_pretraining_writes_a_loadable_asset_and_its_record(pretrained):
    from transformers import AutoModelForImageTextToText

    out = pretrained[0]
    model = AutoModelForImageTextToText.from_pretrained(out / "tiny-vlm")
    assert model.config.image_token_id is not None and (out / "tiny-vlm" / "preprocessor_config.json").is_file()
    assert [len(read_rows(out / "shapes" / f"{split}.parquet")) for split in ("train", "eval")] == [8, 4]
    record = json.loads((out / "tiny-vlm" / "pretrain.json").read_text())
    assert record["args"]["steps"] == 2 and set(record["eval"]) == {"greedy", "temperature_1"}


def test_pretraining_is_deterministic_on_cpu(pretrained):
    first, second = ((out / "tiny-vlm" / "model.safetensors").read_bytes() for out in pretrained)
    assert first == second
