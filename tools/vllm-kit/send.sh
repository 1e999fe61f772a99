#!/usr/bin/env bash
# One git-ignored folder per kit piece, each holding a hard link to its piece (no copies): the piece runs then need
# no step on this machine between them and go out back to back (session 25: eight piece runs in 37 s of device
# time). Then run number NN carries [".vllm-kit-0.33/sendNN"] and copies its piece into /tmp/carry.
#   bash tools/vllm-kit/send.sh .vllm-kit-0.33
# With PIECE_BYTES, the kit's stream (its parts, then extra/'s last piece) is cut anew into pieces of that size under
# KIT_DIR/split/ (sendNN/ there), and KIT_DIR/extra-split/ is extra/ without its piece, its `pieces` the new count:
# the long calls carry extra-split/. For a tree that grew: at 23.1 MB a 44,000,000-byte piece is 20 KB over a
# call's 64 MiB (session 41).
#   bash tools/vllm-kit/send.sh .vllm-kit-0.33 40000000
set -euo pipefail
kit=${1:?usage: send.sh KIT_DIR [PIECE_BYTES]}
if [ -n "${2:-}" ]; then
  rm -rf "$kit/split" "$kit/extra-split" && mkdir -p "$kit/split" "$kit/extra-split"
  shopt -s nullglob
  cat "$kit"/part[0-9][0-9] "$kit"/extra/part[0-9][0-9] | split -b "$2" -d -a 2 - "$kit/split/part"
  for f in "$kit"/extra/*; do
    case ${f##*/} in part[0-9][0-9] | pieces) ;; *) ln "$f" "$kit/extra-split/" ;; esac
  done
  pieces=("$kit"/split/part[0-9][0-9])
  echo "${#pieces[@]}" > "$kit/extra-split/pieces"
  kit=$kit/split
fi
for piece in "$kit"/part[0-9][0-9]; do
  n=${piece##*part}
  rm -rf "$kit/send$n" && mkdir -p "$kit/send$n" && ln "$piece" "$kit/send$n/"
done
ls -d "$kit"/send[0-9][0-9]
