"""Which dynamic symbols do the kit's libraries import that the GPU machine's release of a library lacks?

Decides which NVIDIA libraries must travel: one whose machine release exports every symbol (with its version)
that torch's and vLLM's libraries import from it can stay behind. Give it the unpacked wheels:

  python3 symcheck.py libnccl.so.2 MACHINE_DIR PINNED_DIR CONSUMER.so...
  (e.g. MACHINE_DIR = nvidia-nccl-cu13==2.28.9 unpacked, PINNED_DIR = the 2.29.7 that torch 2.13 pins,
   CONSUMERS = torch/lib/*.so vllm/*.so ...)

It prints, per consumer, how many symbols it takes from the library and those the machine's release lacks.
"""

import os
import subprocess
import sys
from pathlib import Path


def dynamic_symbols(path: Path, undefined: bool) -> set[str]:
    """``name`` or ``name@version`` of each dynamic symbol ``path`` imports (undefined) or exports."""
    flag = "--undefined-only" if undefined else "--defined-only"
    listing = subprocess.run(["nm", "-D", flag, "--with-symbol-versions", str(path)], capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
    return {line.split()[-1].replace("@@", "@") for line in listing.splitlines() if line.split()}


def exports(root: str, soname: str) -> set[str]:
    """Every symbol the files named ``soname*`` under ``root`` export."""
    libs = [p for p in Path(root).rglob(f"{soname}*") if p.is_file() and not p.is_symlink()]
    if not libs:
        raise SystemExit(f"symcheck: no {soname}* under {root}")
    return set().union(*(dynamic_symbols(p, undefined=False) for p in libs))


def provided(symbol: str, exported: set[str], bare: set[str]) -> bool:
    """An import with a version needs that exact version; one without, any version of the name."""
    return symbol in exported if "@" in symbol else symbol in bare


def main(soname: str, machine: str, pinned: str, consumers: list[str]) -> None:
    old, new = exports(machine, soname), exports(pinned, soname)
    old_bare, new_bare = {s.split("@")[0] for s in old}, {s.split("@")[0] for s in new}
    print(f"{soname}: machine's release exports {len(old)} symbols, the pinned one {len(new)}")
    for consumer in consumers:
        taken = {s for s in dynamic_symbols(Path(consumer), undefined=True) if provided(s, new, new_bare)}
        missing = sorted(s for s in taken if not provided(s, old, old_bare))
        if taken:
            print(f"  {os.path.relpath(consumer)}: imports {len(taken)}, missing from the machine's: {len(missing)}")
            for symbol in missing:
                print(f"      {symbol}")


if __name__ == "__main__":
    if len(sys.argv) < 5:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
