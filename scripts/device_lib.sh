# Shared by the scripts that run on the GPU machine (gpu_check.sh, gpu_profile.sh): source it from the
# repository root, after `cd "$(dirname "$0")/.."`.

# device_results NAME: every log goes under $WORK, packed into $OUT/NAME.tgz on exit, whatever step
# ends the run ($OUT: the device tool's folder, else /tmp/attnserve-gpu). The tool returns at most 8
# files, and a check writes more.
device_results() {
  RESULTS=${OUT:-/tmp/attnserve-gpu}
  WORK=$(mktemp -d)
  mkdir -p "$RESULTS"
  # shellcheck disable=SC2064 # the archive's name now, the folders' contents at exit
  trap "tar czf '$RESULTS/$1.tgz' -C '$WORK' ." EXIT
  export PYTHONUNBUFFERED=1
}

# device_python NAME: installs the wheels carried in .whl (scripts/fetch_gpu_wheels.sh) into /tmp/site,
# unless NO_WHEELS is set (a rehearsal on this machine), and puts the tree's client and server first on
# PYTHONPATH. Exits 3, naming NAME, if the install fails.
device_python() {
  if ls .whl/*.whl >/dev/null 2>&1 && [ -z "${NO_WHEELS:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl ||
      { echo "$1: installing the carried wheels failed" >&2; exit 3; }
    export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
  fi
  export PYTHONPATH=$PWD/client:$PWD/server${PYTHONPATH:+:$PYTHONPATH}
}
