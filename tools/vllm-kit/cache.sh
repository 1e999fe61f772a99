#!/usr/bin/env bash
# A device machine's compile caches, from one machine to the next: each session gets a fresh machine, whose first
# 2B quick start spends ~190 s compiling and autotuning fla's Triton kernels and ~290 s in vLLM's cold boot
# (benchmarks/RESULTS.md, session 16). What compiled there is valid on the next machine with the same kit and GPU:
# vLLM's torch.compile cache, Triton's kernels and autotuning results, Inductor's code.
#
#   tools/vllm-kit/cache.sh pack $OUT      # on the machine after a run: $OUT/cache.FMT.partNN (15 MB each), sizes
#   tools/vllm-kit/cache.sh restore DIR    # on a fresh machine: unpack DIR/cache.*.part* where they were
#
# FMT is zst where a zstd runs (the kit's extra/ has one: source its install.sh first), else gz.
#
# A call returns at most 8 files of 16 MiB from $OUT, and a carried path shares the call's 64 MiB with the tree, so
# pieces go back one or two a call (as the kit's do). CACHE_DIRS (absolute paths) replaces the default list.
set -euo pipefail
dirs=${CACHE_DIRS:-"$HOME/.cache/vllm $HOME/.triton /tmp/torchinductor_$(id -un)"}
if zstd --version >/dev/null 2>&1; then fmt=zst; compress=(zstd -q -T0 -10); else fmt=gz; compress=(gzip -6); fi
case "${1:-}" in
  pack)
    out=${2:?pack OUTDIR}
    present=()
    for d in $dirs; do [ -d "$d" ] && present+=("${d#/}") && du -sh "$d"; done
    [ ${#present[@]} -gt 0 ] || { echo "cache.sh: none of $dirs exists"; exit 1; }
    tar -C / -cf - "${present[@]}" | "${compress[@]}" | split -b 15000000 -d - "$out/cache.$fmt.part"
    ls -l "$out"/cache.$fmt.part* | awk '{s += $5} END {print "cache.sh: " NR " pieces, " s " bytes"}'
    ;;
  restore)
    from=${2:?restore DIR}
    started=$SECONDS
    if compgen -G "$from/cache.zst.part*" >/dev/null; then
      cat "$from"/cache.zst.part* | zstd -q -d | tar -C / -xf -
    else
      cat "$from"/cache.gz.part* | gzip -d | tar -C / -xf -
    fi
    echo "cache.sh: restored $(ls "$from"/cache.*.part* | wc -l) pieces in $((SECONDS - started)) s"
    ;;
  *) echo "usage: cache.sh pack OUTDIR | restore DIR"; exit 2 ;;
esac
