"""safetensors files that others read: a server, ``from_pretrained``, a colleague running as another user. Written by
the trainer's checkpoints, LoRA's adapter files and export, below all three."""

from __future__ import annotations

from pathlib import Path

import torch


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors' ``save_file``, with the mode of the process's other files (``umask_mode``)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})
    umask_mode(path)


def umask_mode(path: Path) -> None:
    """Give ``path`` the mode a plain ``open`` would (0644 under the usual umask): safetensors writes its files
    0600, which a server or a colleague running as another user cannot read."""
    status = Path("/proc/self/status")  # read, not set: os.umask would change it for every thread meanwhile
    lines = status.read_text().splitlines() if status.is_file() else []
    umask = next((int(line.split()[1], 8) for line in lines if line.startswith("Umask:")), 0o022)
    path.chmod(0o666 & ~umask)
