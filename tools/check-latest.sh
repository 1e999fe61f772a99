#!/usr/bin/env bash
# Run the test suite against the newest releases of the libraries pyproject.toml bounds from above, bounds lifted,
# in a fresh virtual environment (nothing of this machine's own installs is used). Green: the bound can rise
# (CONTRIBUTING.md, "Raising a dependency bound"). CI never runs this; constraints.txt keeps CI on what was tested.
#
#   tools/check-latest.sh                         # transformers, peft, hydra-core, kernels newest; the whole suite
#   tools/check-latest.sh -- tests/engine -x      # the same, pytest given these arguments
#   PACKAGES="transformers torch" tools/check-latest.sh   # torch too (its CPU build must be on your index)
set -euo pipefail
cd "$(dirname "$0")/.."
packages=${PACKAGES:-transformers peft hydra-core kernels}
[ "${1:-}" = "--" ] && shift
venv=$(mktemp -d /tmp/asyncrl-latest.XXXXXX)
trap 'rm -rf "$venv"' EXIT
python -m venv "$venv"
"$venv/bin/python" -m pip install -q "torch==2.13.0" -e ".[test]"
# Past the bounds on purpose: pip says the result conflicts with asyncrl's requirements, which is the point.
# shellcheck disable=SC2086
"$venv/bin/python" -m pip install -q --upgrade $packages 2>&1 | grep -v "incompatible\|dependency conflicts\|^asyncrl" || true
echo "newest releases under test:"
# shellcheck disable=SC2086
"$venv/bin/python" -m pip list --format freeze 2>/dev/null | grep -iE "^(torch|$(echo $packages | tr ' ' '|'))==" | sed 's/^/  /'
"$venv/bin/python" -m pytest -q "$@"
