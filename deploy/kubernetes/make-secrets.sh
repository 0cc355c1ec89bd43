#!/usr/bin/env bash
# Print the Secrets a tokserve namespace needs, with fresh material, as YAML on stdout:
#   deploy/kubernetes/make-secrets.sh tokserve | kubectl apply -f -
#   (multi-cell: once per cell namespace, e.g. tokserve-cell-a, tokserve-cell-b)
#
# tokserve-tokens  worker.token (a worker's READY must carry it), control.token (CONTROL
#                  commands: pause, weight updates, LoRA; only the broker mounts it; give
#                  it to trainers / an --enable-rl gateway yourself)
# tokserve-curve   zmq.auth certificates from `tokserve curve-keys`: broker.key(_secret),
#                  worker.key(_secret), gateway.key(_secret); each pod mounts only its own
#                  secret key and the public keys it needs (base/*.yaml)
#
# Needs tokserve (or TOKSERVE="python -m common.cli" from a checkout) and kubectl (only to
# format the YAML: nothing is sent to a cluster).  The material lives in a private
# temporary folder, removed on exit; nothing is written anywhere else.
set -euo pipefail
namespace=${1:?usage: make-secrets.sh NAMESPACE}
read -r -a tokserve <<< "${TOKSERVE:-tokserve}"
umask 077
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir "$work/curve"
for name in broker worker gateway; do
    "${tokserve[@]}" curve-keys "$work/curve" --name "$name" > /dev/null
done
python3 -c 'import secrets; print(secrets.token_urlsafe(32))' > "$work/worker.token"
python3 -c 'import secrets; print(secrets.token_urlsafe(32))' > "$work/control.token"
kubectl create secret generic tokserve-tokens --namespace "$namespace" --dry-run=client -o yaml \
    --from-file=worker.token="$work/worker.token" --from-file=control.token="$work/control.token"
echo "---"
kubectl create secret generic tokserve-curve --namespace "$namespace" --dry-run=client -o yaml \
    --from-file="$work/curve"
