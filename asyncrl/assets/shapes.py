"""The `shapes` task that tiny-vlm learns: "How many squares?" over a small drawn image, answered `\\boxed{3}`.

Each image is IMAGE_SIZE pixels square, white, with 1 to MAX_COUNT filled squares of random colour, size and offset,
each inside its own CELL-pixel cell of the GRID x GRID grid. A cell is one merged patch of tiny-vlm's vision tower
(8-pixel patches merged 2x2), so the count is the number of image tokens that hold a square: a count the tiny model
can learn in minutes on a CPU. Rows have DeepMath's conversational shape plus an `image` column (PNG bytes, stored
as datasets' Image feature), so the `accuracy` reward scores them. Used by `asyncrl.assets.pretrain_vlm` and by the
shipped `shapes/{train,eval}.parquet`.
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

IMAGE_SIZE = 48
CELL = 16
"""One merged patch of tiny-vlm (PATCH_SIZE x MERGE_SIZE pixels): a square never spans two image tokens."""
GRID = IMAGE_SIZE // CELL
MAX_COUNT = 4
QUESTION = "How many squares?"
COLORS = ((220, 30, 30), (30, 150, 40), (40, 60, 210), (240, 150, 0), (140, 40, 170), (0, 0, 0))
MIN_SIDE, MAX_SIDE = 5, 12

Row = dict[str, Any]
"""One dataset row: the chat prompt, the image's PNG bytes and the count the accuracy reward checks."""


@dataclass(frozen=True, order=True)
class Square:
    """A filled square: its grid cell, its top-left corner in pixels, its side and colour index."""

    cell: int
    x: int
    y: int
    side: int
    color: int


Layout = tuple[Square, ...]


def random_layout(rng: random.Random, count: int) -> Layout:
    """``count`` squares in distinct random cells, each at a random size, offset and colour in its cell."""
    cells = rng.sample(range(GRID * GRID), count)
    squares = []
    for cell in sorted(cells):
        side = rng.randint(MIN_SIDE, MAX_SIDE)
        x = (cell % GRID) * CELL + rng.randint(0, CELL - side)
        y = (cell // GRID) * CELL + rng.randint(0, CELL - side)
        squares.append(Square(cell, x, y, side, rng.randrange(len(COLORS))))
    return tuple(squares)


def draw(layout: Layout) -> Image.Image:
    """The layout on a white RGB image."""
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), "white")
    canvas = ImageDraw.Draw(image)
    for square in layout:
        canvas.rectangle([square.x, square.y, square.x + square.side - 1, square.y + square.side - 1],
                         fill=COLORS[square.color])  # fmt: skip
    return image


def png_bytes(image: Image.Image) -> bytes:
    """Lossless PNG, so the rows hold exactly the drawn pixels."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def build_row(layout: Layout) -> Row:
    """The row for one layout: the question, its image, the number of squares."""
    return {"prompt": [{"role": "user", "content": QUESTION}], "image": png_bytes(draw(layout)),
            "solution": str(len(layout))}  # fmt: skip


def balanced_counts(rng: random.Random, n: int) -> list[int]:
    """``n`` counts, each of 1..MAX_COUNT as often as ``n`` allows, shuffled: the most common count of a split, the
    accuracy of a model that ignores the image, is then 1 / MAX_COUNT."""
    counts = [index % MAX_COUNT + 1 for index in range(n)]
    rng.shuffle(counts)
    return counts


def split_layouts(seed: int, n_train: int, n_eval: int) -> dict[str, list[Layout]]:
    """Distinct layouts from one seeded stream, the eval split's drawn first: no eval image is a train image."""
    if n_train < 1 or n_eval < 1:
        raise ValueError(f"split_layouts: n_train={n_train} and n_eval={n_eval} must be at least 1")
    rng, seen, splits = random.Random(seed), set(), {}
    for split, n in (("eval", n_eval), ("train", n_train)):
        splits[split] = []
        for count in balanced_counts(rng, n):
            layout = random_layout(rng, count)
            while layout in seen:
                layout = random_layout(rng, count)
            seen.add(layout)
            splits[split].append(layout)
    return {"train": splits["train"], "eval": splits["eval"]}


def build_splits(seed: int, n_train: int, n_eval: int) -> dict[str, list[Row]]:
    """The rows of both splits, fixed by ``seed``."""
    return {split: [build_row(layout) for layout in layouts]
            for split, layouts in split_layouts(seed, n_train, n_eval).items()}  # fmt: skip


def write_splits(out_dir: str | Path, seed: int, n_train: int, n_eval: int) -> dict[str, Path]:
    """Write `train.parquet` and `eval.parquet` under ``out_dir`` (images as datasets' Image feature, which loads them
    as PIL images); returns the path of each split."""
    from datasets import Dataset, Features, List, Value
    from datasets import Image as ImageFeature

    message = {"role": Value("string"), "content": Value("string")}
    features = Features({"prompt": List(message), "image": ImageFeature(), "solution": Value("string")})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, rows in build_splits(seed, n_train, n_eval).items():
        paths[split] = out / f"{split}.parquet"
        Dataset.from_list(rows, features=features).to_parquet(paths[split])
    return paths


def read_rows(path: str | Path) -> list[Row]:
    """Rows of one written split, in file order, each image as its PNG bytes."""
    import pyarrow.parquet as pq

    rows = pq.read_table(path).to_pylist()
    return [{**row, "image": row["image"]["bytes"]} for row in rows]
