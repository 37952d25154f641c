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
{{- $ports := .Values.ray.common.ports }}
{{- if gt (int $ports.minWorker) (int $ports.maxWorker) }}
{{- fail (printf "ray.common.ports: minWorker (%v) is greater than maxWorker (%v)" $ports.minWorker $ports.maxWorker) }}
{{- end }}
{{- $fixed := dict "nodeManager" $ports.nodeManager "objectManager" $ports.objectManager "dashboardAgentGrpc" $ports.dashboardAgentGrpc "dashboardAgentListen" $ports.dashboardAgentListen "metricsExport" $ports.metricsExport "GCS" 6379 "Ray Client" 10001 "dashboard" 8265 }}
{{- $seen := dict }}
{{- range $name, $port := $fixed }}
{{- if and (ge (int $port) (int $ports.minWorker)) (le (int $port) (int $ports.maxWorker)) }}
{{- fail (printf "ray.common.ports: the %s port %v lies in the worker port range %v-%v" $name $port $ports.minWorker $ports.maxWorker) }}
{{- end }}
{{- if hasKey $seen (toString $port) }}
{{- fail (printf "ray.common.ports: the %s and %s ports are both %v" (get $seen (toString $port)) $name $port) }}
{{- end }}
{{- $_ := set $seen (toString $port) $name }}
{{- end }}
{{- with .Values.ray.networkPolicy.gatewayPorts }}
{{- if gt (int .start) (int .end) }}
{{- fail (printf "ray.networkPolicy.gatewayPorts: start (%v) is greater than end (%v)" .start .end) }}
{{- end }}
{{- end }}
{{- $params := dict "ray.head" .Values.ray.head.rayStartParams }}
{{- range $name, $group := $groups }}
{{- $_ := set $params (printf "worker group %s" $name) ($group.rayStartParams | default dict) }}
{{- end }}
{{- range $where, $given := $params }}
{{- range include "opd-trainer.rayPortParamKeys" $ | splitList " " }}
{{- if hasKey $given . }}
{{- fail (printf "%s: rayStartParams.%s: the chart sets Ray's ports (ray.common.ports) so that the NetworkPolicies name them" $where .) }}
{{- end }}
{{- end }}
{{- end }}
{{- $labelled := dict "common.labels" .Values.common.labels "ray.head.labels" .Values.ray.head.labels }}
{{- range $name, $group := $groups }}
{{- $_ := set $labelled (printf "worker group %s labels" $name) ($group.labels | default dict) }}
{{- end }}
{{- range $where, $labels := $labelled }}
{{- if hasKey ($labels | default dict) "app.kubernetes.io/component" }}
{{- fail (printf "%s: app.kubernetes.io/component is the chart's (the NetworkPolicies select pods by it)" $where) }}
{{- end }}
{{- end }}
{{- if .Values.ray.userCodeWorkers.enabled }}
{{- include "opd-trainer.validateUserCodeGroup" . }}
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
What the user-code group must not get, whatever the values say: a Secret (as env, from
ray.common.containerEnv or the group's own, or as a volume), the data volume, a projected volume (it
can carry a service-account token or a Secret), a privileged container.
*/}}
{{- define "opd-trainer.validateUserCodeGroup" -}}
{{- $group := .Values.ray.userCodeWorkers }}
{{- range $entry := concat (.Values.ray.common.containerEnv | default list) ($group.containerEnv | default list) }}
{{- if and $entry.valueFrom $entry.valueFrom.secretKeyRef }}
{{- fail (printf "ray.userCodeWorkers: env %s takes a Secret (from ray.common.containerEnv or ray.userCodeWorkers.containerEnv); user-code pods get none: set it on ray.cpuWorkers or a GPU group instead" $entry.name) }}
{{- end }}
{{- end }}
{{- range $volume := $group.volumes | default list }}
{{- if or $volume.secret $volume.projected (and $volume.persistentVolumeClaim (eq $volume.persistentVolumeClaim.claimName (include "opd-trainer.claimName" $))) }}
{{- fail (printf "ray.userCodeWorkers.volumes: %s is a Secret, a projected volume or the data volume; user-code pods get none" $volume.name) }}
{{- end }}
{{- end }}
{{- if and $group.securityContext $group.securityContext.privileged }}
{{- fail "ray.userCodeWorkers.securityContext.privileged: user-code pods never run privileged" }}
{{- end }}
{{- end }}

{{/* The `ray start` flags that carry ray.common.ports (and the head's fixed ports); groups may not set them. */}}
{{- define "opd-trainer.rayPortParamKeys" -}}
port ray-client-server-port dashboard-port node-manager-port object-manager-port dashboard-agent-grpc-port dashboard-agent-listen-port metrics-export-port min-worker-port max-worker-port worker-port-list
{{- end }}

{{/* ray.common.ports as `ray start` parameters (a YAML map, for fromYaml). */}}
{{- define "opd-trainer.rayPortParams" -}}
{{- with .Values.ray.common.ports -}}
node-manager-port: {{ .nodeManager | int | quote }}
object-manager-port: {{ .objectManager | int | quote }}
dashboard-agent-grpc-port: {{ .dashboardAgentGrpc | int | quote }}
dashboard-agent-listen-port: {{ .dashboardAgentListen | int | quote }}
metrics-export-port: {{ .metricsExport | int | quote }}
min-worker-port: {{ .minWorker | int | quote }}
max-worker-port: {{ .maxWorker | int | quote }}
{{- end }}
{{- end }}

{{/*
Pod selectors of the NetworkPolicies, by the component label every pod template of the chart sets:
"api", "ray-head", "ray-worker" (CPU and GPU groups), "ray-user-code". Call with (list $ COMPONENT...).
*/}}
{{- define "opd-trainer.podsOf" -}}
{{- $root := index . 0 -}}
matchLabels:
  {{- include "opd-trainer.selectorLabels" $root | nindent 2 }}
{{- if eq (len .) 2 }}
  app.kubernetes.io/component: {{ index . 1 }}
{{- else }}
matchExpressions:
  - key: app.kubernetes.io/component
    operator: In
    values:
      {{- range rest . }}
      - {{ . }}
      {{- end }}
{{- end }}
{{- end }}

{{/* NetworkPolicy port entries: TCP `ports` (a list of numbers) and `ranges` (a list of [first, last]). */}}
{{- define "opd-trainer.tcpPorts" -}}
{{- range .ports }}
- protocol: TCP
  port: {{ . | int }}
{{- end }}
{{- range .ranges }}
- protocol: TCP
  port: {{ index . 0 | int }}
  endPort: {{ index . 1 | int }}
{{- end }}
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
  {{- $params := merge (deepCopy ($group.rayStartParams | default dict)) (include "opd-trainer.rayPortParams" $root | fromYaml) }}
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
        app.kubernetes.io/component: {{ if .userCode }}ray-user-code{{ else }}ray-worker{{ end }}
        {{- with $group.labels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $group.annotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      # Nothing on a Ray pod calls the Kubernetes API (the head's autoscaler gets its own token).
      automountServiceAccountToken: false
      {{- if .userCode }}
      {{- with $group.runtimeClassName }}
      runtimeClassName: {{ . }}
      {{- end }}
      {{- if $group.userNamespace }}
      hostUsers: false
      {{- end }}
      # No FOO_SERVICE_HOST variables: the namespace's Services are not the processors' business.
      enableServiceLinks: false
      {{- end }}
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
              containerPort: {{ $root.Values.ray.common.ports.metricsExport }}
          resources:
            {{- $resources := deepCopy $group.resources }}
            {{- if .gpus }}
            {{- $_ := set $resources "requests" (merge (dict "nvidia.com/gpu" .gpus) ($resources.requests | default dict)) }}
            {{- $_ := set $resources "limits" (merge (dict "nvidia.com/gpu" .gpus) ($resources.limits | default dict)) }}
            {{- end }}
            {{- toYaml $resources | nindent 12 }}
          {{- $securityContext := $root.Values.ray.common.securityContext }}
          {{- if .userCode }}
          {{- $securityContext = deepCopy ($group.securityContext | default dict) }}
          {{- if $group.userNamespace }}
          {{- $_ := set $securityContext "procMount" "Unmasked" }}
          {{- end }}
          {{- end }}
          {{- with $securityContext }}
          securityContext:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          {{- $notice := int $root.Values.ray.common.preemptionNoticeSeconds }}
          {{- if and $notice (not .userCode) }}
          lifecycle:
            preStop:
              exec:
                # Jobs with a part on this node checkpoint now (`opd_trainer/cluster/preemption.py`).
                command: ["opd", "preemption-notice", "--grace-s", "{{ $notice }}"]
          {{- end }}
          volumeMounts:
            {{- include "opd-trainer.rayVolumeMounts" (dict "root" $root "extra" $group.volumeMounts "noData" .userCode) | nindent 12 }}
      {{- if and $notice (not .userCode) }}
      terminationGracePeriodSeconds: {{ add $notice 30 }}
      {{- end }}
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
