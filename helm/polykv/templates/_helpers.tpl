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

{{/* The Service the external.metrics.k8s.io APIService routes to. */}}
{{- define "polykv.externalMetricsService" -}}
{{- printf "%s-external-metrics" (include "polykv.operatorName" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Its serving certificate, made once by a hook job (templates/external-metrics.yaml).
Not <service>-tls: the chart rendered that one once, so an upgrade from that layout deletes
it after the job ran. */}}
{{- define "polykv.externalMetricsSecret" -}}
{{- printf "%s-cert" (include "polykv.externalMetricsService" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* One NetworkPolicy peer: pods matching podSelector in the namespaces matching
namespaceSelector, both required to match; without a namespaceSelector, the namespace of
the policy itself (`ns`, or the peer says nothing of namespaces: the policy's own). Never
"any pod of any namespace". */}}
{{- define "polykv.peer" -}}
{{- $sel := .peer.namespaceSelector | default (dict) -}}
{{- if and (not $sel) .ns -}}
{{- $sel = dict "matchLabels" (dict "kubernetes.io/metadata.name" .ns) -}}
{{- end -}}
{{- if or (and (hasKey .peer "namespaceSelector") (empty .peer.namespaceSelector)) (empty .peer.podSelector) -}}
{{- fail "networkPolicy peers need a non-empty podSelector, and a non-empty namespaceSelector or none (the policy's own namespace): {} would admit every pod of every namespace" -}}
{{- end -}}
{{- if $sel -}}
- namespaceSelector: {{ toJson $sel }}
  podSelector: {{ toJson .peer.podSelector }}
{{- else -}}
- podSelector: {{ toJson .peer.podSelector }}
{{- end -}}
{{- end -}}

{{/* The API server as NetworkPolicy egress (or ingress) peers and ports: the addresses in
networkPolicy.apiServer.cidrs, else read from the cluster at install (the `kubernetes`
Service's ClusterIP and its EndpointSlice's addresses and ports). `helm template` and
Argo CD do not read the cluster: there the value is required, and its absence fails the
render naming it (never a rule open to every address). Renders a JSON object
{"peers": [...], "ports": [...]}. */}}
{{- define "polykv.apiServer" -}}
{{- $api := .Values.networkPolicy.apiServer -}}
{{- $cidrs := list -}}
{{- $ports := list -}}
{{- range $api.ports }}{{ $ports = append $ports (int .) }}{{ end -}}
{{- if $api.cidrs -}}
{{- $cidrs = $api.cidrs -}}
{{- else -}}
{{- $svc := lookup "v1" "Service" "default" "kubernetes" -}}
{{- with $svc }}{{ with .spec.clusterIP }}{{ $cidrs = append $cidrs (printf "%s/%s" . (ternary "128" "32" (contains ":" .))) }}{{ end }}{{ end -}}
{{- $slice := lookup "discovery.k8s.io/v1" "EndpointSlice" "default" "kubernetes" -}}
{{- with $slice -}}
{{- range .endpoints }}{{ range .addresses }}{{ $cidrs = append $cidrs (printf "%s/%s" . (ternary "128" "32" (contains ":" .))) }}{{ end }}{{ end -}}
{{- range .ports }}{{ $ports = append $ports (int .port) }}{{ end -}}
{{- end -}}
{{- if not $cidrs -}}
{{- fail "networkPolicy.apiServer.cidrs is empty and the chart could not read the API server's address from the cluster (helm template, Argo CD and --dry-run do not): set it to the API server's addresses, e.g. the kubernetes Service's ClusterIP and kubectl get endpointslice kubernetes -n default -o jsonpath='{.endpoints[*].addresses[*]}', each as a /32 (or networkPolicy.enabled=false)" -}}
{{- end -}}
{{- end -}}
{{- $peers := list -}}
{{- range $cidrs | uniq }}{{ $peers = append $peers (dict "ipBlock" (dict "cidr" .)) }}{{ end -}}
{{- $rules := list -}}
{{- range $ports | uniq }}{{ $rules = append $rules (dict "port" . "protocol" "TCP") }}{{ end -}}
{{- toJson (dict "peers" $peers "ports" $rules) -}}
{{- end -}}

{{/* The egress rule to the API server, for a policy's egress list. */}}
{{- define "polykv.apiServerEgress" -}}
{{- $api := include "polykv.apiServer" . | fromJson -}}
- to: {{ toJson $api.peers }}
  ports: {{ toJson $api.ports }}
{{- end -}}

{{/* DNS, for a policy's egress list. */}}
{{- define "polykv.dnsEgress" -}}
- ports:
    - {port: 53, protocol: UDP}
    - {port: 53, protocol: TCP}
{{- end -}}

{{/* Who may reach each engine and router, as the operator writes their NetworkPolicies
in the engine's own namespace (network_policies.py reads it from
POLYKV_OPERATOR_NETWORK_POLICY): a JSON object. */}}
{{- define "polykv.engineNetworkPolicy" -}}
{{- $np := .Values.networkPolicy -}}
{{- $agents := include "polykv.peer" (dict "peer" $np.agents "ns" "") | fromYamlArray -}}
{{- $scrapers := include "polykv.peer" (dict "peer" $np.scrapers "ns" "") | fromYamlArray -}}
{{- $release := dict "matchLabels" (dict "kubernetes.io/metadata.name" .Release.Namespace) -}}
{{- $operator := dict "namespaceSelector" $release "podSelector" (dict "matchLabels" (include "polykv.operatorSelector" . | fromYaml)) -}}
{{- $test := dict "namespaceSelector" $release "podSelector" (dict "matchLabels" (dict "app.kubernetes.io/name" "polykv-test" "app.kubernetes.io/instance" .Release.Name)) -}}
{{- $routerEgress := concat (include "polykv.apiServerEgress" . | fromYamlArray) (include "polykv.dnsEgress" . | fromYamlArray) -}}
{{- toJson (dict
  "ingress" (concat $agents (list $operator $test) $scrapers)
  "egress" $np.engineEgress
  "modelEgress" $np.modelEgress
  "routerIngress" (concat $agents $scrapers)
  "routerEgress" $routerEgress) -}}
{{- end -}}
