#!/usr/bin/env bash
# Builds the local Kubernetes control plane (etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler, kubectl) and helm from the Go module
# proxy, pinned by e2e/go.mod and e2e/helm/go.mod.
#
# Binaries are cached outside the repo, keyed by Kubernetes version and Go
# version; a stamp of the pinned inputs makes a second run return in seconds.
# The cold build takes 10-15 minutes on 2 cores and prints progress.
#
# Prints the binary directory as the last line of stdout; everything else goes
# to stderr. Override the location with POLYKV_K8S_BIN_DIR.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
E2E="$ROOT/e2e"
GO="${GO:-$(command -v go || echo /usr/local/go/bin/go)}"

# Never fetch a toolchain: a module needing a newer Go must fail loudly.
export GOTOOLCHAIN=local CGO_ENABLED=0

log() { printf '[build-k8s %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }

cd "$E2E"
KV="$("$GO" list -m -f '{{.Version}}' k8s.io/kubernetes)"        # v1.36.3
GOV="$("$GO" env GOVERSION)"                                         # go1.26.8
HELM_V="$(cd helm && "$GO" list -m -f '{{.Version}}' helm.sh/helm/v3)"
HELM_K8S_MINOR="$(cd helm && "$GO" list -m -f '{{.Version}}' k8s.io/client-go | cut -d. -f2)"
OUT="${POLYKV_K8S_BIN_DIR:-$HOME/.cache/polykv/k8s-$KV-$GOV}"
BINS=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl helm)

# Everything that changes the output: module pins, our mains, this script.
stamp() {
  cat go.mod go.sum helm/go.mod helm/go.sum cmd/*/main.go "$ROOT/scripts/build-k8s.sh" \
    | sha256sum | cut -d' ' -f1
}
STAMP="$(stamp)"

cached() {
  [[ -f "$OUT/.stamp" && "$(cat "$OUT/.stamp")" == "$STAMP" ]] || return 1
  local b
  for b in "${BINS[@]}"; do [[ -x "$OUT/$b" ]] || return 1; done
}

if cached; then
  log "cached: $OUT ($KV, $GOV)"
  echo "$OUT"
  exit 0
fi

# One builder at a time per cache directory; the others wait and reuse it.
mkdir -p "$(dirname "$OUT")"
exec 9>"$OUT.lock"
if ! flock -n 9; then
  log "another build of $OUT is running; waiting for it"
  flock 9
fi
if cached; then
  echo "$OUT"
  exit 0
fi

# `go build -v` names each package it compiles: print one line per 100 of them, so a
# long build is visibly alive without thousands of log lines.
progress() {
  local label=$1 total=$2
  awk -v label="$label" -v total="$total" '
    # Compiler errors (and anything else that is not a bare import path) pass through.
    / / || /^#/ { print > "/dev/stderr"; fflush("/dev/stderr"); next }
    ++n % 100 == 0 {
      printf "[build-k8s] %s: %d/~%d packages compiled, at %s\n", label, n, total, $0 > "/dev/stderr"
      fflush("/dev/stderr")
    }'
}

# Linking prints nothing for minutes; say so once a minute.
# Its sleep must die with it: an orphan would hold the caller's output pipe open.
heartbeat() {
  local start=$SECONDS nap
  trap 'kill "$nap" 2>/dev/null; exit 0' TERM
  while :; do
    sleep 60 &
    nap=$!
    wait "$nap"
    log "still building ($(((SECONDS - start) / 60)) min)"
  done
}

TMP="$OUT.tmp.$$"
rm -rf "$TMP"
mkdir -p "$TMP"
heartbeat >/dev/null &
HEARTBEAT=$!
trap 'kill "$HEARTBEAT" 2>/dev/null; rm -rf "$TMP"' EXIT

SECONDS=0
log "cold build of Kubernetes $KV + helm $HELM_V with $GOV into $OUT"
log "this takes a while on few cores (the result is cached; later runs take seconds)"
log "downloading modules"
"$GO" mod download
(cd helm && "$GO" mod download)

MINOR="$(echo "$KV" | cut -d. -f2)"
LD="-s -w"
# The same variables upstream's hack/lib/version.sh stamps, so /version and
# `kubectl version` report the real release instead of v0.0.0-master.
for pkg in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
  LD+=" -X $pkg.gitVersion=$KV -X $pkg.gitMajor=1 -X $pkg.gitMinor=$MINOR"
  LD+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done

TOTAL="$("$GO" list -deps ./cmd/... | wc -l)"
log "compiling ${BINS[*]:0:5} (~$TOTAL packages)"
"$GO" build -v -trimpath -buildvcs=false -ldflags "$LD" -o "$TMP/" ./cmd/... 2>&1 | progress kubernetes "$TOTAL"
log "kubernetes binaries done at $((SECONDS / 60))m$((SECONDS % 60))s"

HLD="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_V"
HLD+=" -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
for pkg in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
  HLD+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$HELM_K8S_MINOR"
done
TOTAL="$(cd helm && "$GO" list -deps helm.sh/helm/v3/cmd/helm | wc -l)"
log "compiling helm (~$TOTAL packages)"
(cd helm && "$GO" build -v -trimpath -buildvcs=false -ldflags "$HLD" -o "$TMP/helm" helm.sh/helm/v3/cmd/helm) 2>&1 \
  | progress helm "$TOTAL"

for b in "${BINS[@]}"; do
  [[ -x "$TMP/$b" ]] || { log "missing $b after build"; exit 1; }
done
"$TMP/kube-apiserver" --version >&2
"$TMP/helm" version --short >&2
echo "$STAMP" >"$TMP/.stamp"
rm -rf "$OUT"
mv "$TMP" "$OUT"
kill "$HEARTBEAT" 2>/dev/null
trap - EXIT
log "done in $((SECONDS / 60))m$((SECONDS % 60))s: $OUT"
echo "$OUT"
