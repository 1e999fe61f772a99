"""The recipes shipped in recipes/ (selected with +recipe=NAME): names and one-line descriptions."""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.config.compose import recipes_dir


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str


def list_recipes() -> list[Recipe]:
    return [Recipe(path.stem, _description(path.read_text())) for path in sorted(recipes_dir().glob("*.yaml"))]


def _description(text: str) -> str:
    """The first comment line that is not a Hydra directive."""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#") and "@package" not in stripped:
            return stripped.lstrip("#").strip()
    return ""
