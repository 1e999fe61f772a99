"""Assets shipped inside the package (the tiny model, the arithmetic data); the embedded default loads them."""

from __future__ import annotations

from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent


def asset_path(name: str) -> Path:
    """Path of a shipped asset, so callers load it like any Hub id (`AutoModelForCausalLM.from_pretrained`)."""
    path = ASSETS_DIR / name
    if not path.exists():
        shipped = sorted(p.name for p in ASSETS_DIR.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))
        raise FileNotFoundError(f"asset_path: no asset {name!r} in {ASSETS_DIR} (shipped: {', '.join(shipped)})")
    return path
