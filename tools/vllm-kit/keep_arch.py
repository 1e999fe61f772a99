"""Drop the GPU code for other architectures from shared libraries' CUDA fat binaries, in place.

A CUDA library carries its kernels once per architecture (sm_75 ... sm_120) in each fat binary of its
``.nv_fatbin`` section (and, for NCCL, relocatable ones in ``__nv_relfatbin``); the driver loads the entry
that matches the GPU. Each fat binary is rewritten to hold what an sm_SM GPU can use, as if it had been
compiled for that one architecture: its sm_SM cubins and its PTX for sm_SM or older (the driver compiles
that when no cubin matches). The kept entries move up unchanged, the header's size shrinks, and the freed
tail is zeroed, so the ELF layout and the pointers to each fat binary stay as they were and the zeros
compress to nothing (libtorch_cuda.so: 310 MB of cubins, 53 MB of them sm_90). A fat binary that would be
left with nothing is left whole: it cannot run on that GPU either way.

usage: python3 keep_arch.py SM FILE...   (SM: 90 for Hopper; prints the bytes dropped per file)
"""

import struct
import subprocess
import sys

FATBIN_MAGIC = 0xBA55ED50
ELF, PTX = 2, 1
SECTIONS = (".nv_fatbin", "__nv_relfatbin")


def fatbin_sections(path: str) -> list[tuple[int, int]]:
    """File offset and size of each fat-binary section of ``path``."""
    listing = subprocess.run(["readelf", "-SW", path], capture_output=True, text=True, check=True).stdout
    found = []
    for line in listing.splitlines():
        fields = line.split("]", 1)[1].split() if "]" in line else []
        if fields and fields[0] in SECTIONS:  # name, type, address, offset, size, ...
            found.append((int(fields[3], 16), int(fields[4], 16)))
    return found


def usable(kind: int, sm: int, keep_sm: int) -> bool:
    """Whether an sm_``keep_sm`` GPU can run the entry: its own cubin, or PTX it can compile."""
    return sm == keep_sm if kind == ELF else kind == PTX and sm <= keep_sm


def prune(data: bytearray, keep_sm: int) -> int:
    """Rewrite every fat binary in ``data`` (one section) to its usable entries; returns the bytes dropped."""
    dropped, pos = 0, 0
    while pos + 16 <= len(data):
        magic, _, header_size, entries_size = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:  # alignment padding between fat binaries
            pos += 8
            continue
        body, end = pos + header_size, pos + header_size + entries_size
        kept, entry = [], body
        while entry < end:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, entry)
            sm = struct.unpack_from("<I", data, entry + 28)[0]
            if usable(kind, sm, keep_sm):
                kept.append(bytes(data[entry : entry + entry_header + payload]))
            entry += entry_header + payload
        if kept:
            packed = b"".join(kept)
            data[body:end] = packed + bytes(entries_size - len(packed))
            struct.pack_into("<Q", data, pos + 8, len(packed))
            dropped += entries_size - len(packed)
        pos = end
    return dropped


def keep_only_arch(path: str, keep_sm: int) -> int:
    """Prune every fat-binary section of ``path`` to what sm_``keep_sm`` runs; returns the bytes dropped."""
    dropped = 0
    with open(path, "r+b") as f:
        for offset, size in fatbin_sections(path):
            f.seek(offset)
            data = bytearray(f.read(size))
            dropped += prune(data, keep_sm)
            f.seek(offset)
            f.write(data)
    return dropped


if __name__ == "__main__":
    sm = int(sys.argv[1])
    for name in sys.argv[2:]:
        print(f"{keep_only_arch(name, sm) / 1e6:9.1f} MB dropped  {name}")
