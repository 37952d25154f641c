{{/* Names, labels and the pieces the API Deployment and the RayCluster share. */}}

{{- define "opd-trainer.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-scoped name prefix, at most 63 characters (a DNS label). */}}
{{- define "opd-trainer.fullname" -}}
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

{{- define "opd-trainer.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "opd-trainer.selectorLabels" -}}
app.kubernetes.io/name: {{ include "opd-trainer.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "opd-trainer.labels" -}}
helm.sh/chart: {{ include "opd-trainer.chart" . }}
{{ include "opd-trainer.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: opd-trainer
{{- with .Values.common.labels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* KubeRay rejects RayCluster names over 53 characters; its head Service is NAME-head-svc. */}}
{{- define "opd-trainer.rayClusterName" -}}
{{- include "opd-trainer.fullname" . | trunc 53 | trimSuffix "-" }}
{{- end }}

{{/* Where the API server reaches Ray: the chart's RayCluster through Ray Client, or ray.address. */}}
{{- define "opd-trainer.rayAddress" -}}
{{- if .Values.ray.enabled }}
{{- printf "ray://%s-head-svc.%s.svc:10001" (include "opd-trainer.rayClusterName" .) .Release.Namespace }}
{{- else }}
{{- required "ray.address is required when ray.enabled is false" .Values.ray.address }}
{{- end }}
{{- end }}

{{- define "opd-trainer.configMapName" -}}
{{- printf "%s-settings" (include "opd-trainer.fullname" .) }}
{{- end }}

{{- define "opd-trainer.secretName" -}}
{{- printf "%s-secrets" (include "opd-trainer.fullname" .) }}
{{- end }}

{{- define "opd-trainer.claimName" -}}
{{- if .Values.persistence.existingClaim }}
{{- .Values.persistence.existingClaim }}
{{- else }}
{{- printf "%s-data" (include "opd-trainer.fullname" .) }}
{{- end }}
{{- end }}

{{- define "opd-trainer.apiImage" -}}
{{- printf "%s:%s" .Values.image.repository .Values.image.apiTag }}
{{- end }}

{{- define "opd-trainer.cpuImage" -}}
{{- printf "%s:%s" .Values.image.repository .Values.image.cpuTag }}
{{- end }}

{{- define "opd-trainer.cudaImage" -}}
{{- printf "%s:%s" .Values.image.repository .Values.image.cudaTag }}
{{- end }}

{{/* The chart stores a Secret only for values not taken from an existing Secret. */}}
{{- define "opd-trainer.needsSecret" -}}
{{- if or (not .Values.adminKey.existingSecret) (and .Values.database.url (not .Values.database.existingSecret)) }}true{{- end }}
{{- end }}

{{/*
The admin key: the value given, else the one an earlier install stored (so upgrades keep it), else a
new random one. `lookup` sees nothing under `helm template`, so there it is always new.
*/}}
{{- define "opd-trainer.adminKey" -}}
{{- if .Values.adminKey.value }}
{{- .Values.adminKey.value }}
{{- else }}
{{- $stored := lookup "v1" "Secret" .Release.Namespace (include "opd-trainer.secretName" .) }}
{{- if and $stored $stored.data (hasKey $stored.data .Values.adminKey.secretKey) }}
{{- index $stored.data .Values.adminKey.secretKey | b64dec }}
{{- else }}
{{- randAlphaNum 48 }}
{{- end }}
{{- end }}
{{- end }}

{{/* OPD_ADMIN_KEY and DATABASE_URL entries of the API container's env. */}}
{{- define "opd-trainer.secretEnv" -}}
- name: OPD_ADMIN_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .Values.adminKey.existingSecret | default (include "opd-trainer.secretName" .) }}
      key: {{ .Values.adminKey.secretKey }}
{{- if .Values.database.existingSecret }}
- name: DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.database.existingSecret }}
      key: {{ .Values.database.secretKey }}
{{- else if .Values.database.url }}
- name: DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "opd-trainer.secretName" . }}
      key: {{ .Values.database.secretKey }}
{{- end }}
{{- end }}

{{/* Fails the render on settings that JSON Schema cannot express. */}}
{{- define "opd-trainer.validate" -}}
{{- if and (gt (int .Values.api.replicaCount) 1) (not (or .Values.database.url .Values.database.existingSecret)) }}
{{- fail "api.replicaCount > 1 needs PostgreSQL: set database.url or database.existingSecret (SQLite on a shared volume takes one writer)" }}
{{- end }}
{{- if .Values.ray.enabled }}
{{- $groups := dict }}
{{- if .Values.ray.cpuWorkers.enabled }}
{{- $_ := set $groups .Values.ray.cpuWorkers.groupName .Values.ray.cpuWorkers }}
{{- end }}
{{- if .Values.ray.userCodeWorkers.enabled }}
{{- if hasKey $groups .Values.ray.userCodeWorkers.groupName }}
{{- fail (printf "ray.userCodeWorkers.groupName: %s is already used by ray.cpuWorkers.groupName" .Values.ray.userCodeWorkers.groupName) }}
{{- end }}
{{- if hasKey .Values.ray.userCodeWorkers.rayStartParams "resources" }}
{{- fail "ray.userCodeWorkers.rayStartParams.resources: the chart sets it (the opd_user_code resource)" }}
{{- end }}
{{- $_ := set $groups .Values.ray.userCodeWorkers.groupName .Values.ray.userCodeWorkers }}
{{- end }}
{{- range $name, $group := .Values.ray.gpuWorkerGroups }}
{{- if $group.enabled }}
{{- if hasKey $groups $name }}
{{- fail (printf "ray.gpuWorkerGroups.%s: the group name is already used by another worker group" $name) }}
{{- end }}
{{- $_ := set $groups $name $group }}
{{- end }}
{{- end }}
{{- range $name, $group := $groups }}
{{- if gt (int $group.minReplicas) (int $group.maxReplicas) }}
{{- fail (printf "worker group %s: minReplicas (%v) is greater than maxReplicas (%v)" $name $group.minReplicas $group.maxReplicas) }}
{{- end }}
{{- if or (lt (int $group.replicas) (int $group.minReplicas)) (gt (int $group.replicas) (int $group.maxReplicas)) }}
{{- fail (printf "worker group %s: replicas (%v) must lie between minReplicas (%v) and maxReplicas (%v)" $name $group.replicas $group.minReplicas $group.maxReplicas) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* The Ray resource that only user-code pods advertise; processor workers require one unit. */}}
{{- define "opd-trainer.userCodeResource" -}}
opd_user_code
{{- end }}

{{/* Whether processor workers go to their own group (the RayCluster is ours and has that group). */}}
{{- define "opd-trainer.userCodeGroup" -}}
{{- if and .Values.ray.enabled .Values.ray.userCodeWorkers.enabled }}true{{ end }}
{{- end }}

{{/*
Volumes every Ray pod gets: the in-memory /dev/shm (Docker's 64 MB default is too small for the
shared-memory weight handoff and Ray's object store), Ray's session/log dir, and the data volume
(unless "noData": the user-code group). Call with (dict "root" $ "shmSize" SIZE "extra" LIST
["noData" true]).
*/}}
{{- define "opd-trainer.rayVolumes" -}}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .shmSize }}
- name: ray-tmp
  emptyDir: {}
{{- if and .root.Values.ray.common.mountDataVolume (not .noData) }}
- name: data
  {{- if .root.Values.persistence.enabled }}
  persistentVolumeClaim:
    claimName: {{ include "opd-trainer.claimName" .root }}
  {{- else }}
  emptyDir: {}
  {{- end }}
{{- end }}
{{- with .extra }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "opd-trainer.rayVolumeMounts" -}}
- name: dshm
  mountPath: /dev/shm
- name: ray-tmp
  mountPath: /tmp/ray
{{- if and .root.Values.ray.common.mountDataVolume (not .noData) }}
- name: data
  mountPath: {{ .root.Values.persistence.mountPath }}
{{- end }}
{{- with .extra }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* env of a Ray container: ray.common.containerEnv, then the group's own. Call with (list common group). */}}
{{- define "opd-trainer.rayEnv" -}}
{{- with concat (index . 0 | default list) (index . 1 | default list) -}}
env:
{{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/*
One worker group of the RayCluster. Call with
(dict "root" $ "name" NAME "group" GROUP "image" IMAGE "gpus" N ["userCode" true]).
A user-code group mounts no data volume and advertises the user-code resource.
*/}}
{{- define "opd-trainer.workerGroup" -}}
{{- $root := .root -}}
{{- $group := .group -}}
- groupName: {{ .name }}
  replicas: {{ $group.replicas }}
  minReplicas: {{ $group.minReplicas }}
  maxReplicas: {{ $group.maxReplicas }}
  {{- $params := deepCopy ($group.rayStartParams | default dict) }}
  {{- if .userCode }}
  {{- /* KubeRay's format: a double-quoted, escaped JSON object ("{\"name\": N}"), which both the
  `ray start` command line and its autoscaler parse. */}}
  {{- $resources := printf "{\"%s\": 100000}" (include "opd-trainer.userCodeResource" $root) }}
  {{- $_ := set $params "resources" (printf "%q" $resources) }}
  {{- end }}
  {{- with $params }}
  rayStartParams:
    {{- range $key, $value := . }}
    {{ $key }}: {{ $value | quote }}
    {{- end }}
  {{- end }}
  template:
    metadata:
      labels:
        {{- include "opd-trainer.labels" $root | nindent 8 }}
        app.kubernetes.io/component: ray-worker
        {{- with $group.labels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $group.annotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $root.Values.common.podSecurityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      containers:
        - name: ray-worker
          image: {{ .image }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          {{- with include "opd-trainer.rayEnv" (list $root.Values.ray.common.containerEnv $group.containerEnv) }}
          {{- . | nindent 10 }}
          {{- end }}
          envFrom:
            - configMapRef:
                name: {{ include "opd-trainer.configMapName" $root }}
          ports:
            - name: metrics
              containerPort: 8080
          resources:
            {{- $resources := deepCopy $group.resources }}
            {{- if .gpus }}
            {{- $_ := set $resources "requests" (merge (dict "nvidia.com/gpu" .gpus) ($resources.requests | default dict)) }}
            {{- $_ := set $resources "limits" (merge (dict "nvidia.com/gpu" .gpus) ($resources.limits | default dict)) }}
            {{- end }}
            {{- toYaml $resources | nindent 12 }}
          {{- with $root.Values.ray.common.securityContext }}
          securityContext:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          volumeMounts:
            {{- include "opd-trainer.rayVolumeMounts" (dict "root" $root "extra" $group.volumeMounts "noData" .userCode) | nindent 12 }}
      volumes:
        {{- include "opd-trainer.rayVolumes" (dict "root" $root "shmSize" $group.shmSize "extra" $group.volumes "noData" .userCode) | nindent 8 }}
      {{- with $group.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $group.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $group.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end }}
