#!/usr/bin/env bash
# One git-ignored folder per kit piece, each holding a hard link to its piece (no copies): the piece runs then need
# no step on this machine between them and go out back to back (session 25: eight piece runs in 37 s of device
# time). Then run number NN carries [".vllm-kit-0.33/sendNN"] and copies its piece into /tmp/carry.
#   bash tools/vllm-kit/send.sh .vllm-kit-0.33
set -euo pipefail
kit=${1:?usage: send.sh KIT_DIR}
for piece in "$kit"/part[0-9][0-9]; do
  n=${piece##*part}
  rm -rf "$kit/send$n" && mkdir -p "$kit/send$n" && ln "$piece" "$kit/send$n/"
done
ls -d "$kit"/send[0-9][0-9]
