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
What the operator does inside a namespace it watches. No wildcards; Secrets are only created and deleted
(never read); pods, nodes and the jobs' rendezvous ConfigMaps are watched through one label-selected watch
each. Each job gets a ServiceAccount, Role and RoleBinding whose Role allows get, watch, update and patch on
that job's rendezvous ConfigMap alone: RBAC lets the operator grant only what it holds itself (no escalate
or bind verbs here), so it holds those verbs on ConfigMaps.
*/}}
{{- define "sneppx-operator.namespacedRules" -}}
- apiGroups: ["sneppx.io"]
  resources: ["elastictrainingjobs"]
  # delete: ttlSecondsAfterFinished
  verbs: ["get", "list", "watch", "patch", "delete"]
- apiGroups: ["sneppx.io"]
  resources: ["elastictrainingjobs/status"]
  verbs: ["get", "patch"]
# Setting blockOwnerDeletion on owned objects needs this where OwnerReferencesPermissionEnforcement is on.
- apiGroups: ["sneppx.io"]
  resources: ["elastictrainingjobs/finalizers"]
  verbs: ["update"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "delete"]
# get: an object whose name is taken is checked for its controller before it is adopted or deleted.
- apiGroups: [""]
  resources: ["services", "serviceaccounts"]
  verbs: ["get", "create", "delete"]
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "create", "delete"]
# Never readable: the job's Secret is recognised by its name, which carries the job's uid.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create", "delete"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
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
