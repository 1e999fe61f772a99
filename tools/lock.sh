#!/usr/bin/env bash
# Write constraints.txt: every package a fresh `pip install "torch==2.13.0" -e ".[test]"` resolves to today, pinned.
# .ci/run and the README's two commands install through it (pip -c), so a new upstream release cannot change what CI
# tests. Rerun after changing a dependency or raising a bound (CONTRIBUTING.md), then run the suite and commit both.
#
#   tools/lock.sh            # resolve within pyproject's bounds, newest allowed; writes constraints.txt
set -euo pipefail
cd "$(dirname "$0")/.."
report=$(mktemp)
trap 'rm -f "$report"' EXIT
# pip's own resolver, as a dry run against an empty environment: what a new machine would install, nothing installed.
python -m pip install -q --dry-run --ignore-installed --report "$report" "torch==2.13.0" -e ".[test]"
python - "$report" > constraints.txt <<'PY'
import json
import sys

from packaging.utils import canonicalize_name
from packaging.version import Version

report = json.load(open(sys.argv[1]))
print("# Written by tools/lock.sh from pip's resolution of `torch==2.13.0 -e .[test]`; do not edit by hand.")
pins = {}
for item in report["install"]:
    name = canonicalize_name(item["metadata"]["name"])
    if name != "asyncrl":
        pins[name] = Version(item["metadata"]["version"]).public  # torch 2.13.0+cpu pins as 2.13.0: any build
for name in sorted(pins):
    print(f"{name}=={pins[name]}")
PY
echo "constraints.txt: $(grep -c '==' constraints.txt) pins"
