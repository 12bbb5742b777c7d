#!/usr/bin/env bash
# End to end on a kind cluster, for machines with Docker. (The project's CI has no Docker: tests/k8s
# runs the same checks against a real kube-apiserver + etcd instead, and tests/image builds this image
# with buildah and runs the operator from it; this script is not run there.)
#
# Builds the image, loads it into a fresh kind cluster, installs the chart, runs a small
# ElasticTrainingJob in a namespace that enforces the restricted Pod Security profile, and checks
# that it reaches Running, suspends, resumes and cleans up after deletion.
#
#   scripts/e2e-kind.sh              # KEEP=1 keeps the cluster afterwards; CLUSTER, IMAGE override names
set -euo pipefail

CLUSTER=${CLUSTER:-sneppx-e2e}
IMAGE=${IMAGE:-sneppx:e2e}
KEEP=${KEEP:-0}
NS=e2e
repo=$(cd "$(dirname "$0")/.." && pwd)

for tool in docker kind kubectl helm; do
  command -v "$tool" >/dev/null || { echo "e2e-kind: '$tool' is required on PATH" >&2; exit 2; }
done

cleanup() { [ "$KEEP" = 1 ] || kind delete cluster --name "$CLUSTER"; }
kind create cluster --name "$CLUSTER" --wait 180s
trap cleanup EXIT
kubectl config use-context "kind-$CLUSTER"

docker build -t "$IMAGE" "$repo"
kind load docker-image "$IMAGE" --name "$CLUSTER"

helm install sneppx "$repo/charts/sneppx-operator" --namespace sneppx-system --create-namespace \
  --set image.repository="${IMAGE%:*}" --set image.tag="${IMAGE##*:}" --set image.pullPolicy=Never \
  --wait --timeout 180s

kubectl create namespace "$NS"
kubectl label namespace "$NS" pod-security.kubernetes.io/enforce=restricted
kubectl -n "$NS" apply -f - <<EOF
apiVersion: v1
kind: PersistentVolumeClaim
metadata:
  name: training-checkpoints
spec:
  accessModes: [ReadWriteOnce]   # kind's local-path class; one node, so every rank can mount it
  resources:
    requests:
      storage: 1Gi
---
apiVersion: sneppx.io/v1alpha1
kind: ElasticTrainingJob
metadata:
  name: e2e
spec:
  template:
    spec:
      containers:
        - name: trainer
          image: $IMAGE
          imagePullPolicy: Never
          command: ["python", "-c", "import SneppX_ALG, os, time; print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], flush=True); time.sleep(3600)"]
  elastic:
    minNodes: 2
    maxNodes: 2
  checkpoint:
    storage:
      pvc:
        claimName: training-checkpoints
EOF

echo "waiting for the job to run..."
kubectl -n "$NS" wait --for=jsonpath='{.status.phase}'=Running etj/e2e --timeout=300s
kubectl -n "$NS" get etj e2e
kubectl -n "$NS" logs e2e-1 | grep -q "rank 1 of 2"

echo "suspend..."
kubectl -n "$NS" patch etj e2e --type=merge -p '{"spec":{"suspend":true}}'
kubectl -n "$NS" wait --for=jsonpath='{.status.phase}'=Suspended etj/e2e --timeout=120s
kubectl -n "$NS" wait --for=delete pod -l sneppx.io/job=e2e --timeout=120s

echo "resume..."
kubectl -n "$NS" patch etj e2e --type=merge -p '{"spec":{"suspend":false}}'
kubectl -n "$NS" wait --for=jsonpath='{.status.phase}'=Running etj/e2e --timeout=300s

echo "delete..."
kubectl -n "$NS" delete etj e2e --timeout=120s
kubectl -n "$NS" wait --for=delete pod -l sneppx.io/job=e2e --timeout=120s
if kubectl -n "$NS" get service e2e >/dev/null 2>&1 || kubectl -n "$NS" get secret e2e-heartbeat >/dev/null 2>&1; then
  echo "e2e-kind: the job's Service or Secret survived its deletion" >&2
  exit 1
fi
echo "e2e-kind: passed"
