{{- define "attnserve.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "attnserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "attnserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "attnserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: {{ .Values.variant }}
{{- end -}}

{{- define "attnserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "attnserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "attnserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "attnserve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "attnserve.image" -}}
{{- if not (has .Values.variant (list "cpu" "gpu")) -}}
{{- fail (printf "variant: expected cpu or gpu, got %q" .Values.variant) -}}
{{- end -}}
{{- $suffix := ternary "cuda" "cpu" (eq .Values.variant "gpu") -}}
{{- printf "%s:%s" .Values.image.repository (default (printf "%s-%s" .Chart.AppVersion $suffix) .Values.image.tag) -}}
{{- end -}}
