{{/* The agent's name: one agent per GPU node, one release per cluster (its ClusterRoles,
PriorityClasses and admission policy are cluster-wide), so names are fixed, not per release. */}}
{{- define "gpu-hotplug.name" -}}gpu-hotplug-agent{{- end -}}
{{- define "gpu-hotplug.metricsReader" -}}gpu-hotplug-metrics-reader{{- end -}}

{{- define "gpu-hotplug.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpu-hotplug.name" . }}
{{- end -}}

{{/* What Helm adds to the labels kustomize gives every object. */}}
{{- define "gpu-hotplug.commonLabels" -}}
app.kubernetes.io/part-of: jupyter-gpu-hotplug
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "gpu-hotplug.labels" -}}
{{ include "gpu-hotplug.selectorLabels" . }}
{{ include "gpu-hotplug.commonLabels" . }}
{{- end -}}

{{/* repository@digest when a digest is given (pinned, what signature policies verify), else
repository:tag. */}}
{{- define "gpu-hotplug.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end -}}

{{- define "gpu-hotplug.serviceAccount" -}}
system:serviceaccount:{{ .Release.Namespace }}:{{ include "gpu-hotplug.name" . }}
{{- end -}}
