{{/* Names and labels shared by every template. */}}

{{- define "polykv.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "polykv.operatorName" -}}
{{- printf "%s-operator" (include "polykv.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "polykv.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/part-of: polykv
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "polykv.operatorSelector" -}}
app.kubernetes.io/name: polykv-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "polykv.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "polykv.operatorName" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "polykv.masterKeySecret" -}}
{{- default (printf "%s-master-key" (include "polykv.fullname" .)) .Values.masterKey.existingSecret -}}
{{- end -}}

{{- define "polykv.operatorImage" -}}
{{- printf "%s:%s" .Values.image.operator.repository (default .Chart.AppVersion .Values.image.operator.tag) -}}
{{- end -}}

{{- define "polykv.engineImage" -}}
{{- printf "%s:%s" .Values.image.engine.repository (default .Chart.AppVersion .Values.image.engine.tag) -}}
{{- end -}}

{{- define "polykv.routerImage" -}}
{{- printf "%s:%s" .Values.image.router.repository (default .Chart.AppVersion .Values.image.router.tag) -}}
{{- end -}}

{{/* The restricted Pod Security profile, for pods and for containers. */}}
{{- define "polykv.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.podSecurity.runAsUser }}
runAsGroup: {{ .Values.podSecurity.runAsGroup }}
seccompProfile: {type: RuntimeDefault}
{{- end -}}

{{- define "polykv.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities: {drop: [ALL]}
seccompProfile: {type: RuntimeDefault}
{{- end -}}

{{/* Pods of chart jobs and tests: the operator image, its security, pull secrets. */}}
{{- define "polykv.jobPodSpec" -}}
restartPolicy: Never
securityContext:
  {{- include "polykv.podSecurityContext" . | nindent 2 }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.operator.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.operator.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Namespaces holding engines: the release's, every one the operator serves
(operator.watchNamespaces), the listed ones, those of `engines`. */}}
{{- define "polykv.engineNamespaces" -}}
{{- $out := list .Release.Namespace -}}
{{- range .Values.operator.watchNamespaces }}{{ $out = append $out . }}{{ end -}}
{{- range .Values.networkPolicy.engineNamespaces }}{{ $out = append $out . }}{{ end -}}
{{- range .Values.engines }}{{ $out = append $out (default $.Release.Namespace .namespace) }}{{ end -}}
{{- $out | uniq | toJson -}}
{{- end -}}

{{/* The Service the external.metrics.k8s.io APIService routes to. */}}
{{- define "polykv.externalMetricsService" -}}
{{- printf "%s-external-metrics" (include "polykv.operatorName" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* One NetworkPolicy peer: pods matching podSelector in the namespaces matching
namespaceSelector, both required to match; without a namespaceSelector, the namespace of
the policy itself (`ns`). Never "any pod of any namespace". */}}
{{- define "polykv.peer" -}}
{{- $sel := .peer.namespaceSelector | default (dict "matchLabels" (dict "kubernetes.io/metadata.name" .ns)) -}}
{{- if or (empty $sel) (empty .peer.podSelector) -}}
{{- fail "networkPolicy peers need a non-empty podSelector, and a non-empty namespaceSelector or none (the policy's own namespace): {} would admit every pod of every namespace" -}}
{{- end -}}
- namespaceSelector: {{ toJson $sel }}
  podSelector: {{ toJson .peer.podSelector }}
{{- end -}}
