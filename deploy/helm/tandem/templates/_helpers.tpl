{{/* Names and labels shared by every manifest. */}}
{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tandem.fullname" -}}
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

{{- define "tandem.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "tandem.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Selector labels; "component" tells the serving pods from the prefill workers. */}}
{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "tandem.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{- define "tandem.apiKeysSecret" -}}
{{- default (printf "%s-api-keys" (include "tandem.fullname" .)) .Values.apiKeys.existingSecret }}
{{- end }}

{{- define "tandem.hasApiKeys" -}}
{{- if or .Values.apiKeys.existingSecret .Values.apiKeys.keys }}true{{ end }}
{{- end }}

{{/* Seconds Kubernetes waits after SIGTERM: the preStop pause, the drain, a margin. */}}
{{- define "tandem.terminationGracePeriod" -}}
{{- add (int .Values.server.preStopSleepS) (int .Values.server.shutdownTimeoutS) 15 }}
{{- end }}

{{/* Environment every Tandem container shares: the ConfigMap, the API keys, the
     service id that names the pod's shared-memory segments. */}}
{{- define "tandem.commonEnv" -}}
- name: TANDEM_SERVICE_ID
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
{{- if include "tandem.hasApiKeys" . }}
- name: TANDEM_API_KEYS
  valueFrom:
    secretKeyRef:
      name: {{ include "tandem.apiKeysSecret" . }}
      key: api-keys
{{- end }}
{{- end }}

{{- define "tandem.envFrom" -}}
- configMapRef:
    name: {{ include "tandem.fullname" . }}
{{- end }}

{{/* Volumes: /dev/shm in memory, /tmp for runtime sockets (the root file system is
     read-only), the CurveZMQ keys when given. */}}
{{- define "tandem.volumes" -}}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.shm.sizeLimit }}
- name: tmp
  emptyDir: {}
{{- if .Values.curveKeys.existingSecret }}
- name: curve-keys
  secret:
    secretName: {{ .Values.curveKeys.existingSecret }}
    defaultMode: 0400
{{- end }}
{{- end }}

{{- define "tandem.volumeMounts" -}}
- name: dshm
  mountPath: /dev/shm
- name: tmp
  mountPath: /tmp
{{- if .Values.curveKeys.existingSecret }}
- name: curve-keys
  mountPath: /etc/tandem/curve
  readOnly: true
{{- end }}
{{- end }}

{{- define "tandem.workerResources" -}}
{{- $r := deepCopy (default .Values.resources .Values.workerResources) }}
{{- if .Values.gpu.enabled }}
{{- $limits := default dict $r.limits }}
{{- $_ := set $limits "nvidia.com/gpu" .Values.gpu.count }}
{{- $_ := set $r "limits" $limits }}
{{- end }}
{{- toYaml $r }}
{{- end }}

{{- define "tandem.httpProbes" -}}
startupProbe:
  httpGet:
    path: /readyz
    port: http
  periodSeconds: {{ .Values.probes.startup.periodSeconds }}
  failureThreshold: {{ .Values.probes.startup.failureThreshold }}
readinessProbe:
  httpGet:
    path: /readyz
    port: http
  periodSeconds: {{ .Values.probes.readiness.periodSeconds }}
  failureThreshold: {{ .Values.probes.readiness.failureThreshold }}
livenessProbe:
  httpGet:
    path: /livez
    port: http
  periodSeconds: {{ .Values.probes.liveness.periodSeconds }}
  failureThreshold: {{ .Values.probes.liveness.failureThreshold }}
lifecycle:
  preStop:
    exec:
      command: ["sleep", "{{ .Values.server.preStopSleepS }}"]
{{- end }}

{{/* A pod template's metadata; call with (dict "ctx" $ "component" NAME). */}}
{{- define "tandem.podMeta" -}}
{{- $ctx := .ctx }}
labels:
  {{- include "tandem.selectorLabels" $ctx | nindent 2 }}
  app.kubernetes.io/component: {{ .component }}
  {{- with $ctx.Values.podLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
annotations:
  checksum/config: {{ include (print $ctx.Template.BasePath "/configmap.yaml") $ctx | sha256sum }}
  {{- with $ctx.Values.podAnnotations }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end }}

{{- define "tandem.podSpecCommon" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
terminationGracePeriodSeconds: {{ include "tandem.terminationGracePeriod" . }}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
