{{/* Names and labels shared by every template, so one place decides how objects are named. */}}

{{- define "sneppx-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* "<release>-<chart>", or just the release name when it already contains the chart name. */}}
{{- define "sneppx-operator.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "sneppx-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "sneppx-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sneppx-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "sneppx-operator.labels" -}}
helm.sh/chart: {{ include "sneppx-operator.chart" . }}
{{ include "sneppx-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: sneppx
{{- end }}

{{- define "sneppx-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "sneppx-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "sneppx-operator.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/*
What the operator does inside a namespace it watches: exactly the calls it makes (operator/sneppx_operator/k8s.py
and the watches in handlers.py; tests/k8s/test_helm.py holds the two to each other), no wildcards. Pods, nodes
and the jobs' rendezvous ConfigMaps are watched through one label-selected watch each; a name already taken is
read to name its holder; Secrets are only created (a job's Secret is recognised by its name, which carries the
job's uid); only pods (restarts) and jobs (ttlSecondsAfterFinished) are deleted: the garbage collector removes
the rest with their job. Each job gets a ServiceAccount, Role and RoleBinding whose Role allows get and patch on
that job's rendezvous ConfigMap alone: RBAC lets the operator grant only what it holds itself (no escalate or
bind verbs here), so it holds those verbs on ConfigMaps.
*/}}
{{- define "sneppx-operator.namespacedRules" -}}
- apiGroups: ["sneppx.io"]
  resources: ["elastictrainingjobs"]
  # get: each pass reads the job; patch: a finalizer of an older operator taken off; delete: the TTL
  verbs: ["get", "list", "watch", "patch", "delete"]
- apiGroups: ["sneppx.io"]
  resources: ["elastictrainingjobs/status"]
  verbs: ["patch"]
# Setting blockOwnerDeletion on owned objects needs this where OwnerReferencesPermissionEnforcement is on.
- apiGroups: ["sneppx.io"]
  resources: ["elastictrainingjobs/finalizers"]
  verbs: ["update"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "delete"]
- apiGroups: [""]
  resources: ["services", "serviceaccounts"]
  verbs: ["get", "create"]
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "create"]
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end }}

{{/*
The leader election's Lease, in the release's namespace: read by every replica, created by them (it is no chart
object, so no `helm upgrade` ever refuses or deletes one the replicas made), renewed (a compare-and-swap update)
by the leader. The operator's Deployment is read for its uid alone: a Lease names it as its owner, so the
garbage collector deletes the Lease with the release.
*/}}
{{- define "sneppx-operator.leaseRules" -}}
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  resourceNames: [{{ include "sneppx-operator.fullname" . | quote }}]
  verbs: ["get", "update"]
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  # create can't be limited by name
  verbs: ["create"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  resourceNames: [{{ include "sneppx-operator.fullname" . | quote }}]
  verbs: ["get"]
{{- end }}

{{/*
Cluster-level reads: the CRDs (kopf notices the ElasticTrainingJob resource come and go), the nodes (a rank
on a NotReady node is replaced) and, only when watching a list of namespaces (which may be globs), the
namespaces themselves.
*/}}
{{- define "sneppx-operator.clusterRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["list", "watch"]
{{- if .Values.watchNamespaces }}
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- end }}
{{- end }}
