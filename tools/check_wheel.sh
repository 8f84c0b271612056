#!/usr/bin/env bash
# Build a wheel, install it into a fresh venv and run the smoke test from
# outside the source tree (so nothing can be imported from the checkout).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m pip wheel "$repo" --no-deps -w "$work/dist"
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q "$work"/dist/llamax-*.whl
cp "$repo/tests/smoke.py" "$work/"
# a fresh venv has no path into the checkout: llamax can only come from the wheel
# (the model comes from the cache, or is fetched: llamax.models.default_model)
cd "$work" && "$work/venv/bin/python" -I "$work/smoke.py"
echo "wheel OK: $(ls "$work"/dist)"
