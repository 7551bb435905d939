{{/*
Shared definitions of the inferq chart: names, labels, images, the environment every process
gets, and the pod-level settings every Deployment shares (docs/kubernetes.md).
*/}}

{{- define "inferq.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "inferq.fullname" -}}
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

{{- define "inferq.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels: (dict "root" $ "component" "api"). They never change after install. */}}
{{- define "inferq.selectorLabels" -}}
app.kubernetes.io/name: {{ include "inferq.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Every object's labels: (dict "root" $ "component" "api"). */}}
{{- define "inferq.labels" -}}
{{ include "inferq.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: inferq
helm.sh/chart: {{ include "inferq.chart" .root }}
{{- end }}

{{/* An image reference: (dict "root" $ "image" .Values.image); the tag defaults to appVersion. */}}
{{- define "inferq.image" -}}
{{- printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag | toString) }}
{{- end }}

{{- define "inferq.secretName" -}}
{{- default (printf "%s-secrets" (include "inferq.fullname" .)) .Values.secrets.existingSecret }}
{{- end }}

{{/* The name jobs use for a model: servedModelName, else the model id (as INFERQ_SERVED_MODEL_NAME). */}}
{{- define "inferq.servedName" -}}
{{- default .model .servedModelName }}
{{- end }}

{{/*
INFERQ_ADAPTERS: every model's LoRA adapters in one JSON object, {"name": {"base", "path"}},
the same value on every process (docs/scheduling.md, "Many models"). Also checks the models' names.
*/}}
{{- define "inferq.adapters" -}}
{{- $adapters := dict }}
{{- $names := dict }}
{{- $served := dict }}
{{- range $i, $m := .Values.models }}
{{- if hasKey $names $m.name }}
{{- fail (printf "models[%d].name %q is used twice" $i $m.name) }}
{{- end }}
{{- $_ := set $names $m.name true }}
{{- $base := include "inferq.servedName" $m }}
{{- if hasKey $served $base }}
{{- fail (printf "models[%d]: served model name %q is used twice" $i $base) }}
{{- end }}
{{- $_ := set $served $base true }}
{{- range (($m.lora | default dict).adapters | default list) }}
{{- if hasKey $adapters .name }}
{{- fail (printf "LoRA adapter %q is registered twice" .name) }}
{{- end }}
{{- $_ := set $adapters .name (dict "base" $base "path" .path) }}
{{- end }}
{{- end }}
{{- range $name, $_ := $adapters }}
{{- if hasKey $served $name }}
{{- fail (printf "LoRA adapter %q has the name of a served model" $name) }}
{{- end }}
{{- end }}
{{- $adapters | toJson }}
{{- end }}

{{/*
The environment of a container, as a list of EnvVar: (dict "root" $ "set" DICT "extra" LIST).
First the database and Redis URLs (from the Secret), then `config` (settings for every process),
then "set" (name -> string: what the chart computes for this container, plus the models'
catalog: INFERQ_ADAPTERS, INFERQ_ACCEPTED_MODELS, INFERQ_MODEL_TASKS, INFERQ_SERVED_MODEL_NAME,
the same on every process), then "extra" (the component's own `env`, copied as given). A `config` key that the chart sets here is refused:
the chart's value is tied to the pod spec (ports, grace period), so a second one could not win.
*/}}
{{- define "inferq.env" -}}
{{- $root := .root }}
{{- $set := .set | default dict }}
{{- $_ := set $set "INFERQ_ADAPTERS" (include "inferq.adapters" $root) }}
{{- $served := list }}
{{- $tasks := dict }}
{{- range $m := $root.Values.models }}
{{- $served = append $served (include "inferq.servedName" $m) }}
{{- with $m.task }}
{{- $_ := set $tasks (include "inferq.servedName" $m) . }}
{{- end }}
{{- end }}
{{- if $tasks }}
{{- /* What each model does, for the API to route each kind of job before any worker of it has
announced itself (docs/openai.md, "Embeddings, rerank and score"). */}}
{{- $_ := set $set "INFERQ_MODEL_TASKS" ($tasks | toJson) }}
{{- end }}
{{- if $served }}
{{- /* Every model of the chart is known with or without a live worker (scaled to zero);
the first is the default model of jobs that name none. A worker sets its own name. */}}
{{- $_ := set $set "INFERQ_ACCEPTED_MODELS" (join "," $served) }}
{{- if not (hasKey $set "INFERQ_SERVED_MODEL_NAME") }}
{{- $_ := set $set "INFERQ_SERVED_MODEL_NAME" (first $served) }}
{{- end }}
{{- end }}
{{- $secret := include "inferq.secretName" $root }}
- name: INFERQ_DATABASE_URL
  valueFrom:
    secretKeyRef: {name: {{ $secret }}, key: {{ $root.Values.secrets.keys.databaseUrl }}}
- name: INFERQ_REDIS_URL
  valueFrom:
    secretKeyRef: {name: {{ $secret }}, key: {{ $root.Values.secrets.keys.redisUrl }}}
{{- range $name := keys $root.Values.config | sortAlpha }}
{{- if or (hasKey $set $name) (has $name (list "INFERQ_DATABASE_URL" "INFERQ_REDIS_URL" "INFERQ_WEBHOOK_SECRET" "INFERQ_METRICS_ADVERTISE_HOST")) }}
{{- fail (printf "config.%s: the chart sets this setting itself (docs/kubernetes.md, \"Models\")" $name) }}
{{- end }}
- name: {{ $name }}
  value: {{ index $root.Values.config $name | quote }}
{{- end }}
{{- range $name := keys $set | sortAlpha }}
- name: {{ $name }}
  value: {{ index $set $name | quote }}
{{- end }}
{{- with .extra }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* INFERQ_METRICS_ADVERTISE_HOST: the pod's IP, what /metrics/targets lists for Prometheus. */}}
{{- define "inferq.advertiseEnv" -}}
- name: INFERQ_METRICS_ADVERTISE_HOST
  valueFrom:
    fieldRef: {fieldPath: status.podIP}
{{- end }}

{{/*
Pod-level settings every inferq pod shares. enableServiceLinks is off: Kubernetes would
otherwise put <SERVICE>_PORT=tcp://... variables in every container, and a Service named
inferq-api (this chart's, for a release named inferq) becomes INFERQ_API_PORT, which inferq
reads as a setting and refuses. No pod talks to the Kubernetes API: no token is mounted.
*/}}
{{- define "inferq.podSpecCommon" -}}
enableServiceLinks: false
automountServiceAccountToken: false
{{- with .Values.serviceAccountName }}
serviceAccountName: {{ . }}
{{- end }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Scheduling: (dict "nodeSelector" .. "tolerations" .. "affinity" ..). */}}
{{- define "inferq.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/*
Writable directories under a read-only root: /tmp, /data (INFERQ_DATA_DIR in the image: beat's
schedule file, the API's multiprocess metrics) and the home directory (caches; a worker's vLLM,
torch and Triton keep theirs there). Add (dict "root" $ "files" true) for /files, the batch
files the API and the ops workers share: the claim of files.existingClaim, or the embedded
store's (inferq.filesClaim).
*/}}
{{- define "inferq.volumes" -}}
- name: tmp
  emptyDir: {}
- name: data
  emptyDir: {}
- name: home
  emptyDir: {}
{{- with (and .files (include "inferq.filesClaim" .root)) }}
- name: files
  persistentVolumeClaim:
    claimName: {{ . }}
{{- end }}
{{- end }}

{{- define "inferq.volumeMounts" -}}
- {name: tmp, mountPath: /tmp}
- {name: data, mountPath: /data}
- {name: home, mountPath: /home/inferq}
{{- if and .files (include "inferq.filesClaim" .root) }}
- {name: files, mountPath: /files}
{{- end }}
{{- end }}

{{/*
The store of the bytes of files, the API's and the ops workers' (docs/files.md): "url" (the
object store of files.url), "claim" (files.existingClaim, ReadWriteMany), "embedded" (neither,
with batches on: the claim the chart makes, files-claim.yaml), or "" (neither, batches off:
none is needed).
*/}}
{{- define "inferq.filesStore" -}}
{{- $files := .Values.files }}
{{- if $files.url }}url
{{- else if $files.existingClaim }}claim
{{- else if .Values.batches.enabled }}embedded
{{- end }}
{{- end }}

{{/* The claim mounted at /files, or "" (a bucket, or no store). */}}
{{- define "inferq.filesClaim" -}}
{{- $store := include "inferq.filesStore" . }}
{{- if eq $store "claim" }}{{ .Values.files.existingClaim }}
{{- else if eq $store "embedded" }}{{ include "inferq.fullname" . }}-files
{{- end }}
{{- end }}

{{/*
The pod label that gathers the embedded store's users on its node: every pod that mounts the
ReadWriteOnce claim carries it and requires a node running a pod of the release that carries it
(inferq.filesScheduling). The first of them to start matches its own term, so it may go anywhere
(Kubernetes' rule for a pod that matches its own affinity); the others follow it. Empty unless
the store is the embedded one.
*/}}
{{- define "inferq.filesLabels" -}}
{{- if eq (include "inferq.filesStore" .) "embedded" }}
inferq.io/files: embedded
{{- end }}
{{- end }}

{{/*
Scheduling of a pod that mounts /files, (dict "root" $ "part" .Values.api): the part's own
nodeSelector, tolerations and affinity, plus, with the embedded store, a required pod affinity
to the node of the store's other users (the part's own podAffinity terms are kept).
*/}}
{{- define "inferq.filesScheduling" -}}
{{- $affinity := deepCopy (.part.affinity | default dict) }}
{{- with (include "inferq.filesLabels" .root | fromYaml) }}
{{- $labels := merge (dict "app.kubernetes.io/instance" $.root.Release.Name) . }}
{{- $term := dict "labelSelector" (dict "matchLabels" $labels) "topologyKey" "kubernetes.io/hostname" }}
{{- $pod := get $affinity "podAffinity" | default dict }}
{{- $required := get $pod "requiredDuringSchedulingIgnoredDuringExecution" | default list }}
{{- $_ := set $pod "requiredDuringSchedulingIgnoredDuringExecution" (append $required $term) }}
{{- $_ := set $affinity "podAffinity" $pod }}
{{- end }}
{{- include "inferq.scheduling" (dict "nodeSelector" .part.nodeSelector "tolerations" .part.tolerations "affinity" $affinity) }}
{{- end }}

{{/*
Whether the API has a HorizontalPodAutoscaler ("true" or ""), and its replicas without one.
null values follow the store of files: the embedded one serves one replica (no autoscaling,
1 replica); a shared one (files.url, files.existingClaim) or none (batches off) scales (2).
*/}}
{{- define "inferq.apiAutoscaled" -}}
{{- $enabled := .Values.api.autoscaling.enabled }}
{{- if kindIs "invalid" $enabled }}
{{- $enabled = ne (include "inferq.filesStore" .) "embedded" }}
{{- end }}
{{- if $enabled }}true{{ end }}
{{- end }}

{{- define "inferq.apiReplicas" -}}
{{- $replicas := .Values.api.replicas }}
{{- if kindIs "invalid" $replicas }}
{{- $replicas = ternary 1 2 (eq (include "inferq.filesStore" .) "embedded") }}
{{- end }}
{{- $replicas | int }}
{{- end }}

{{/*
Rules across values, each refused with a sentence that says what to set (a schema's allOf or
anyOf would answer with a trace of its branches). Rendered first by api.yaml. `helm lint` does
not stop at `fail` (helm's lint mode logs it): `helm template` and `helm install` do.
*/}}
{{- define "inferq.checkValues" -}}
{{- $files := .Values.files }}
{{- $api := .Values.api }}
{{- with $files.url }}
{{- if not (regexMatch "^(s3|s3a|gs|az|abfs|file)://" .) }}
{{- fail (printf "files.url %q is not a store inferq knows: set s3://bucket/prefix (AWS S3; with files.endpoint, an S3-compatible store), gs://bucket/prefix or az://container/prefix (docs/files.md)" .) }}
{{- end }}
{{- if $files.existingClaim }}
{{- fail "files.url and files.existingClaim are both set: set one, a bucket (files.url) or a ReadWriteMany claim (files.existingClaim)" }}
{{- end }}
{{- end }}
{{- if eq (include "inferq.filesStore" .) "embedded" }}
{{- $shared := "set files.url (s3://bucket/prefix) or files.existingClaim (a ReadWriteMany claim) for a store every replica reaches (docs/kubernetes.md, \"Batch files\")" }}
{{- if include "inferq.apiAutoscaled" . }}
{{- fail (printf "api.autoscaling.enabled=true: the embedded file store serves one API replica (a ReadWriteOnce claim, files.url and files.existingClaim being empty); %s, or api.autoscaling.enabled=false" $shared) }}
{{- end }}
{{- if gt (include "inferq.apiReplicas" . | int) 1 }}
{{- fail (printf "api.replicas=%d: the embedded file store serves one API replica (a ReadWriteOnce claim, files.url and files.existingClaim being empty); %s, or api.replicas=1" ($api.replicas | int) $shared) }}
{{- end }}
{{- end }}
{{- if and .Values.ingress.enabled (not .Values.ingress.hosts) }}
{{- fail "ingress.enabled=true needs a host: set ingress.hosts (--set ingress.hosts[0]=inferq.example.com), each routed to the API" }}
{{- end }}
{{- end }}

{{/*
Where the API and the ops workers keep the bytes of files (docs/files.md), into (dict "root" $
"set" $set): the object store of files.url, else the claim at /files (files.existingClaim or
the embedded store's); and whether batches are on. Credentials are not settings:
files.credentialsSecret comes in as the environment (inferq.filesEnvFrom), or the service
account's role does.
*/}}
{{- define "inferq.filesSet" -}}
{{- $files := .root.Values.files }}
{{- if $files.url }}
{{- $_ := set .set "INFERQ_FILES_URL" $files.url }}
{{- with $files.endpoint }}{{ $_ := set $.set "INFERQ_FILES_ENDPOINT" . }}{{ end }}
{{- with $files.region }}{{ $_ := set $.set "INFERQ_FILES_REGION" . }}{{ end }}
{{- else if include "inferq.filesClaim" .root }}
{{- $_ := set .set "INFERQ_FILES_DIR" "/files" }}
{{- end }}
{{- $_ := set .set "INFERQ_BATCHES_ENABLED" (toString .root.Values.batches.enabled) }}
{{- end }}

{{- define "inferq.filesEnvFrom" -}}
{{- with .Values.files.credentialsSecret }}
envFrom:
  - secretRef: {name: {{ . }}}
{{- end }}
{{- end }}

{{/*
Pod annotations, (dict "root" $ "extra" .podAnnotations): checksum/secret rolls the pods when
the chart's Secret changes (env is read at start), then the component's own.
*/}}
{{- define "inferq.podAnnotations" -}}
{{- $all := dict }}
{{- if not .root.Values.secrets.existingSecret }}
{{- $_ := set $all "checksum/secret" (include (print .root.Template.BasePath "/secret.yaml") .root | sha256sum) }}
{{- end }}
{{- range $k, $v := .extra }}
{{- $_ := set $all $k $v }}
{{- end }}
{{- with $all }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
