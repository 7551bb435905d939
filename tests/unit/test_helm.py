"""The Helm chart deploy/helm/inferq: linted and rendered by a real helm, every object validated.

helm (.ci/install-helm) lints the chart with `--strict` and renders it with its default values
(nothing else set: batch files on the embedded store) and with each file of ci/. Every rendered
object is validated in strict mode: Kubernetes' own kinds against Kubernetes' schemas
(kubernetes-validate), KEDA's ScaledObject and the Prometheus Operator's ServiceMonitor and
PodMonitor against models generated from their CRDs (cloudcoil), with unknown fields refused; a
planted bad object shows each validator refuses. Then the chart's promises (docs/kubernetes.md):
a misspelt value fails naming the key, a wrong combination fails with a sentence saying what to
set, migrations run as a pre-install/pre-upgrade hook, beat runs once, a worker's grace period
is its drain time + 60 s, KEDA owns the replicas of the models it scales, and every variable the
chart sets is a documented setting. Without helm (or the validators) the tests skip, and fail
instead under INFERQ_TEST_REQUIRE_HELM=1, as .ci/run sets.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import re
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NoReturn

import pydantic
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "inferq"
GPU_VALUES = CHART / "ci" / "gpu-two-models-values.yaml"
S3_VALUES = CHART / "ci" / "object-storage-values.yaml"
CLUSTER_VALUES = CHART / "ci" / "cluster-values.yaml"
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "inferq.json"
RELEASE = "inferq"
# The schemas of the Kubernetes that the pinned helm and kubectl target (1.35).
KUBERNETES = "1.35.0"
# The values each render uses: name -> values files. "default": the chart's defaults alone, as a
# first `helm install` gets them (batch files in the embedded store); "bucket": them in S3.
RENDERS: dict[str, list[Path]] = {
    "default": [],
    "bucket": [S3_VALUES],
    "gpu": [GPU_VALUES],
    "cluster": [CLUSTER_VALUES],
}
LABELS = {
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
    "app.kubernetes.io/component",
    "app.kubernetes.io/managed-by",
    "helm.sh/chart",
}

HELM_HOMES = ("HELM_CONFIG_HOME", "HELM_CACHE_HOME", "HELM_DATA_HOME")

Obj = dict[str, Any]


def missing(what: str) -> NoReturn:
    """Skip for want of a tool, or fail where CI requires it."""
    if os.environ.get("INFERQ_TEST_REQUIRE_HELM") == "1":
        pytest.fail(f"{what} (INFERQ_TEST_REQUIRE_HELM=1: .ci/install-helm, .ci/install dev)")
    pytest.skip(what)


@pytest.fixture(scope="module")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """The helm command, with its config and cache in a temporary directory."""
    found = shutil.which("helm") or shutil.which("helm", path=str(REPO / ".venv" / "bin"))
    if not found:
        missing("helm is not installed")
    home = tmp_path_factory.mktemp("helm-home")
    saved = {k: os.environ.get(k) for k in HELM_HOMES}
    for key in saved:
        os.environ[key] = str(home / key.lower())
    yield [found]
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def run(command: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


def template(helm: list[str], *args: str) -> subprocess.CompletedProcess[str]:
    """``helm template`` of the chart with ``args`` over its default values."""
    return run([*helm, "template", RELEASE, str(CHART), "--namespace", "inferq", *args])


def install(helm: list[str], *args: str) -> subprocess.CompletedProcess[str]:
    """``helm install --dry-run=client``: what a user's first install prints (NOTES.txt too),
    without a cluster."""
    return run(
        [*helm, "install", RELEASE, str(CHART), "--namespace", "inferq", "--dry-run=client", *args]
    )


def objects(done: subprocess.CompletedProcess[str]) -> list[Obj]:
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def values_args(files: list[Path]) -> list[str]:
    return [arg for path in files for arg in ("-f", str(path))]


@pytest.fixture(scope="module")
def renders(helm: list[str]) -> dict[str, list[Obj]]:
    """Each render's objects, hooks included, rendered once for the module."""
    out = {}
    for name, files in RENDERS.items():
        out[name] = objects(template(helm, *values_args(files)))
    return out


@pytest.fixture(scope="module")
def validators() -> SimpleNamespace:
    """kubernetes-validate and the CRD models (the dev extra of pyproject.toml)."""
    try:
        kubernetes_validate = importlib.import_module("kubernetes_validate")
        keda = importlib.import_module("cloudcoil.models.keda.v1alpha1")
        monitoring = importlib.import_module("cloudcoil.models.prometheus_operator.v1")
    except ImportError as exc:
        missing(f"a validator is not installed: {exc}")
    return SimpleNamespace(
        kubernetes=kubernetes_validate,
        custom={
            ("keda.sh/v1alpha1", "ScaledObject"): keda.ScaledObject,
            ("monitoring.coreos.com/v1", "ServiceMonitor"): monitoring.ServiceMonitor,
            ("monitoring.coreos.com/v1", "PodMonitor"): monitoring.PodMonitor,
        },
    )


def validate(validators: SimpleNamespace, obj: Obj) -> None:
    """Raise unless ``obj`` is valid: strict (no unknown field, no wrong type)."""
    model = validators.custom.get((obj["apiVersion"], obj["kind"]))
    if model is not None:
        # JSON mode, as the API server reads it; extra="forbid" refuses unknown fields, which
        # the API server's strict field validation refuses too.
        model.model_validate_json(json.dumps(obj), strict=True, extra="forbid")
    else:
        validators.kubernetes.validate(obj, KUBERNETES, strict=True)


def of_kind(objs: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objs if o["kind"] == kind]


def named(objs: list[Obj], kind: str, suffix: str) -> Obj:
    """The one object of ``kind`` named <release>-<suffix> (<release> for an empty suffix)."""
    name = f"{RELEASE}-{suffix}" if suffix else RELEASE
    (found,) = [o for o in of_kind(objs, kind) if o["metadata"]["name"] == name]
    return found


def worker_pod(objs: list[Obj], model: Obj) -> Obj:
    """The pod spec of a model's worker Deployment."""
    spec: Obj = named(objs, "Deployment", f"worker-{model['name']}")["spec"]["template"]["spec"]
    return spec


def pod_specs(objs: list[Obj]) -> Iterator[tuple[str, Obj]]:
    for o in objs:
        if o["kind"] in ("Deployment", "Job"):
            yield o["metadata"]["name"], o["spec"]["template"]["spec"]


def env_of(container: Obj) -> dict[str, Obj]:
    return {e["name"]: e for e in container.get("env", [])}


def models_of(files: list[Path]) -> list[Obj]:
    """The models a render was given: the last values file that sets them, else the chart's."""
    models: list[Obj] = yaml.safe_load((CHART / "values.yaml").read_text())["models"]
    for path in files:
        models = yaml.safe_load(path.read_text()).get("models", models)
    return models


@pytest.mark.parametrize("render", RENDERS)
def test_helm_lint_strict(helm: list[str], render: str) -> None:
    done = run([*helm, "lint", "--strict", str(CHART), *values_args(RENDERS[render])])
    assert done.returncode == 0, done.stdout + done.stderr


def test_renders_the_expected_objects(renders: dict[str, list[Obj]]) -> None:
    kinds = {name: sorted({o["kind"] for o in objs}) for name, objs in renders.items()}
    # The defaults: batch files on the embedded store's claim, one API replica (no HPA).
    assert kinds["default"] == [
        "Deployment",
        "Job",
        "PersistentVolumeClaim",
        "PodDisruptionBudget",
        "Secret",
        "Service",
    ]
    assert kinds["bucket"] == [
        "Deployment",
        "HorizontalPodAutoscaler",
        "Job",
        "PodDisruptionBudget",
        "Secret",
        "Service",
    ]
    assert {"ScaledObject", "ServiceMonitor", "ConfigMap"} <= set(kinds["gpu"])
    assert "Secret" not in kinds["gpu"]  # secrets.existingSecret
    # API, ops with beat (and the dispatcher's loop), one worker per model; the GPU file adds
    # ops without beat and more dispatchers.
    assert len(of_kind(renders["default"], "Deployment")) == 2 + len(models_of([]))
    assert len(of_kind(renders["bucket"], "Deployment")) == 2 + len(models_of([]))
    assert len(of_kind(renders["gpu"], "Deployment")) == 4 + len(models_of(RENDERS["gpu"]))


@pytest.mark.parametrize("render", RENDERS)
def test_every_object_validates_strictly(
    renders: dict[str, list[Obj]], validators: SimpleNamespace, render: str
) -> None:
    for obj in renders[render]:
        try:
            validate(validators, obj)
        except Exception as exc:
            pytest.fail(f"{obj['kind']} {obj['metadata']['name']}: {exc}")


def test_pod_monitor_validates_strictly(helm: list[str], validators: SimpleNamespace) -> None:
    done = template(helm, "--set", "metrics.podMonitor.enabled=true")
    assert done.returncode == 0, done.stderr
    monitors = [o for o in yaml.safe_load_all(done.stdout) if o and o["kind"] == "PodMonitor"]
    assert len(monitors) == 1
    validate(validators, monitors[0])
    ports = {e["port"] for e in monitors[0]["spec"]["podMetricsEndpoints"]}
    assert ports == {"http", "metrics"}


def planted(obj: Obj, path: str, value: Any) -> Obj:
    """A copy of ``obj`` with ``value`` at ``path`` (dotted; digits index lists); DROP removes."""
    obj = copy.deepcopy(obj)
    *parents, last = path.split(".")
    node: Any = obj
    for part in parents:
        node = node[int(part)] if part.isdigit() else node[part]
    if value is DROP:
        del node[last]
    else:
        node[last] = value
    return obj


DROP = object()
CONTAINER = "spec.template.spec.containers.0"
# Mistakes planted in rendered objects: an unknown field, a wrong type, a missing field.
PLANTED = [
    ("Deployment", "worker-llama-8b", f"{CONTAINER}.imagePullPolcy", "Always"),
    ("Deployment", "worker-llama-8b", "spec.progressDeadlineSeconds", "9"),
    ("ScaledObject", "worker-qwen-small", "spec.fallback.replica", 1),
    ("ScaledObject", "worker-qwen-small", "spec.triggers.0.metdata", {}),
    ("ScaledObject", "worker-qwen-small", "spec.minReplicaCount", "0"),
    ("ScaledObject", "worker-qwen-small", "spec.triggers.0.metadata.threshold", 1),
    ("ScaledObject", "worker-qwen-small", "spec.scaleTargetRef", DROP),
    ("ServiceMonitor", "", "spec.endpoints.0.intervl", "1s"),
    ("ServiceMonitor", "", "spec.endpoints", {"port": "http"}),
]


def test_the_validators_refuse_planted_bad_objects(
    renders: dict[str, list[Obj]], validators: SimpleNamespace
) -> None:
    refused = (pydantic.ValidationError, validators.kubernetes.ValidationError)
    for kind, name, path, value in PLANTED:
        obj = named(renders["gpu"], kind, name)
        validate(validators, obj)  # as rendered: valid
        bad = planted(obj, path, value)
        with pytest.raises(refused) as caught:
            validate(validators, bad)
        # The error points at the planted field (kubernetes-validate keeps the path apart).
        where = f"{caught.value} {list(getattr(caught.value, 'path', []))}"
        assert path.rsplit(".", 1)[-1] in where, (kind, path, where)


@pytest.mark.parametrize(
    ("args", "key"),
    [
        (["--set", "api.replica=3"], "replica"),
        (["--set", "keda.pollingIntervall=10"], "pollingIntervall"),
        (["--set-json", 'models=[{"name": "a", "model": "m", "gpus": {"cuont": 1}}]'], "cuont"),
        (
            ["--set-json", 'models=[{"name": "a", "model": "m", "lanes": ["bulk"], "drain": 1}]'],
            "drain",
        ),
    ],
)
def test_a_misspelt_value_fails_naming_the_key(helm: list[str], args: list[str], key: str) -> None:
    for command in (
        [*helm, "template", RELEASE, str(CHART), *args],
        [*helm, "lint", "--strict", str(CHART), *args],
    ):
        done = run(command)
        assert done.returncode != 0, command
        assert f"'{key}'" in done.stdout + done.stderr, done.stdout + done.stderr


def test_the_ops_workers_dispatcher_cannot_be_turned_off_in_config(helm: list[str]) -> None:
    done = template(helm, "--set-string", "config.INFERQ_OPS_DISPATCH=false")
    assert done.returncode != 0
    assert "config.INFERQ_OPS_DISPATCH" in done.stderr


def test_a_setting_the_chart_owns_is_refused_in_config(helm: list[str]) -> None:
    done = template(helm, "--set-string", "config.INFERQ_SHUTDOWN_GRACE_S=5")
    assert done.returncode != 0
    assert "config.INFERQ_SHUTDOWN_GRACE_S" in done.stderr


def test_migrations_run_before_the_new_code(renders: dict[str, list[Obj]]) -> None:
    for objs in renders.values():
        (job,) = of_kind(objs, "Job")
        annotations = job["metadata"]["annotations"]
        assert annotations["helm.sh/hook"] == "pre-install,pre-upgrade"
        assert set(annotations["helm.sh/hook-delete-policy"].split(",")) == {
            "before-hook-creation",
            "hook-succeeded",
        }
        assert job["spec"]["template"]["spec"]["containers"][0]["args"][:2] == ["inferq", "migrate"]
        # The chart's own Secret exists before the Job that reads it: a hook of lower weight.
        for secret in of_kind(objs, "Secret"):
            hooks = secret["metadata"]["annotations"]
            assert hooks["helm.sh/hook"] == "pre-install,pre-upgrade"
            assert int(hooks["helm.sh/hook-weight"]) < int(annotations["helm.sh/hook-weight"])


def test_beat_runs_once(renders: dict[str, list[Obj]]) -> None:
    for name, objs in renders.items():
        ops = named(objs, "Deployment", "ops")
        assert ops["spec"]["replicas"] == 1
        assert ops["spec"]["strategy"] == {"type": "Recreate"}
        env = env_of(ops["spec"]["template"]["spec"]["containers"][0])
        assert env["INFERQ_OPS_BEAT"]["value"] == "true"
        # ... and the dispatcher's loop, so the install always sends its waiting jobs.
        assert env["INFERQ_OPS_DISPATCH"]["value"] == "true"
        extra = [o for o in of_kind(objs, "Deployment") if o["metadata"]["name"].endswith("-extra")]
        for deployment in extra:
            env = env_of(deployment["spec"]["template"]["spec"]["containers"][0])
            assert env["INFERQ_OPS_BEAT"]["value"] == "false"
        assert len(extra) == (1 if name == "gpu" else 0)


@pytest.mark.parametrize("render", RENDERS)
def test_worker_grace_period_is_its_drain_time_plus_60(
    renders: dict[str, list[Obj]], render: str
) -> None:
    models = models_of(RENDERS[render])
    assert models
    for model in models:
        pod = worker_pod(renders[render], model)
        (container,) = pod["containers"]
        drain = model.get("drainSeconds", 120)
        assert env_of(container)["INFERQ_SHUTDOWN_GRACE_S"]["value"] == str(drain)
        assert pod["terminationGracePeriodSeconds"] == drain + 60
        startup = container["startupProbe"]
        assert startup["httpGet"]["path"] == "/healthz"
        assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
        waited = startup["failureThreshold"] * startup["periodSeconds"]
        assert model.get("startupSeconds", 1800) <= waited < model.get("startupSeconds", 1800) + 10


def test_keda_scales_the_models_of_the_gpu_file(renders: dict[str, list[Obj]]) -> None:
    objs = renders["gpu"]
    for model in models_of(RENDERS["gpu"]):
        deployment = named(objs, "Deployment", f"worker-{model['name']}")
        assert "replicas" not in deployment["spec"]  # KEDA's HPA owns it
        scaled = named(objs, "ScaledObject", f"worker-{model['name']}")["spec"]
        assert scaled["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
        assert scaled["minReplicaCount"] == model["minReplicas"]
        assert scaled["maxReplicaCount"] == model["maxReplicas"]
        assert scaled["fallback"] == {"failureThreshold": 3, "replicas": model["replicas"]}
        assert (scaled["pollingInterval"], scaled["cooldownPeriod"]) == (30, 300)
        (trigger,) = scaled["triggers"]
        assert trigger["type"] == "prometheus"
        assert trigger["metricType"] == "AverageValue"
        served = model.get("servedModelName") or model["model"]
        assert trigger["metadata"]["query"] == (
            f'max(inferq_autoscale_desired_workers{{model="{served}"}})'
        )
        assert trigger["metadata"]["threshold"] == "1"
        assert trigger["metadata"]["activationThreshold"] == "0"
        assert ("advanced" in scaled) == ("autoscaling" in model)
    for model in models_of(RENDERS["default"]):
        deployment = named(renders["default"], "Deployment", f"worker-{model['name']}")
        assert deployment["spec"]["replicas"] == model["replicas"]


def test_gpu_requests_follow_tensor_parallelism(renders: dict[str, list[Obj]]) -> None:
    for model in models_of(RENDERS["gpu"]):
        pod = worker_pod(renders["gpu"], model)
        (container,) = pod["containers"]
        tp = model.get("vllmConfig", {}).get("tensorParallelSize", 1)
        assert container["resources"]["limits"]["nvidia.com/gpu"] == model["gpus"].get("count", tp)
        engine_args = env_of(container).get("INFERQ_VLLM_ENGINE_ARGS", {"value": "{}"})
        args = json.loads(engine_args["value"])
        assert args.get("tensor_parallel_size", 1) == tp
        assert pod["nodeSelector"]["nvidia.com/gpu.product"] == model["gpus"]["type"]
        assert {v["name"] for v in pod["volumes"]} >= {"dshm", "model-storage"}


def test_every_variable_the_chart_sets_is_a_documented_setting(
    renders: dict[str, list[Obj]],
) -> None:
    table = (REPO / "docs" / "settings.md").read_text()
    documented = set(re.findall(r"^\| `(INFERQ_[A-Z0-9_]+)` \|", table, re.M))
    assert documented
    # Variables a values file adds itself (a model's `env`) are the user's; the chart's own that
    # are not settings: the Hugging Face token and the first operator key, from Secrets.
    given = {"HF_TOKEN", "OPERATOR_API_KEY"}
    for path in RENDERS["gpu"]:
        values = yaml.safe_load(path.read_text())
        parts = [*values.get("models", []), *(v for v in values.values() if isinstance(v, dict))]
        given |= {e["name"] for part in parts for e in part.get("env", [])}
    unknown = {
        (name, env)
        for objs in renders.values()
        for name, pod in pod_specs(objs)
        for container in pod["containers"]
        for env in env_of(container)
        if env not in documented | given
    }
    assert unknown == set()


def test_every_pod_is_locked_down(renders: dict[str, list[Obj]]) -> None:
    for objs in renders.values():
        for name, pod in pod_specs(objs):
            # Service links would set INFERQ_API_PORT=tcp://... from this chart's own Service.
            assert pod["enableServiceLinks"] is False, name
            assert pod["automountServiceAccountToken"] is False, name
            # The Dockerfile's USER inferq is uid 1000; a numeric uid lets runAsNonRoot be checked.
            assert pod["securityContext"]["runAsNonRoot"] is True, name
            assert pod["securityContext"]["runAsUser"] == 1000, name
            for container in pod["containers"]:
                assert container["securityContext"]["allowPrivilegeEscalation"] is False, name


def test_every_container_keeps_the_images_init(renders: dict[str, list[Obj]]) -> None:
    """The image's ENTRYPOINT (tini, PID 1) hands SIGTERM to inferq: a container's `command`
    would replace it, so the chart sets `args` (the image's CMD) only."""
    entrypoint = next(
        line
        for line in (REPO / "Dockerfile").read_text().splitlines()
        if line.startswith("ENTRYPOINT")
    )
    assert "tini" in entrypoint, entrypoint
    for objs in renders.values():
        for name, pod in pod_specs(objs):
            for container in pod["containers"]:
                assert "command" not in container, name
                assert container["args"][0] == "inferq", name


def test_every_object_carries_the_standard_labels(renders: dict[str, list[Obj]]) -> None:
    for objs in renders.values():
        for obj in objs:
            assert set(obj["metadata"]["labels"]) >= LABELS, obj["metadata"]["name"]


def test_the_dashboard_is_the_one_copy(renders: dict[str, list[Obj]]) -> None:
    linked = CHART / "dashboards" / "inferq.json"
    assert linked.is_symlink()
    assert linked.resolve() == DASHBOARD.resolve()
    (config_map,) = of_kind(renders["gpu"], "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"]["inferq.json"]) == json.loads(DASHBOARD.read_text())


def test_the_packaged_chart_carries_the_dashboard(helm: list[str], tmp_path: Path) -> None:
    done = run([*helm, "package", str(CHART), "--destination", str(tmp_path)])
    assert done.returncode == 0, done.stderr
    (archive,) = tmp_path.glob("inferq-*.tgz")
    with tarfile.open(archive) as tar:
        member = tar.extractfile("inferq/dashboards/inferq.json")
        assert member is not None
        assert json.loads(member.read()) == json.loads(DASHBOARD.read_text())


def test_each_models_task_reaches_its_workers_and_every_process(
    renders: dict[str, list[Obj]],
) -> None:
    """docs/kubernetes.md, "Models": a model's ``task`` is its workers' INFERQ_MODEL_TASK, and
    every process knows every model's (INFERQ_MODEL_TASKS), so the API routes an embedding
    call to an embedding model before any of its workers has started."""
    objs = renders["gpu"]
    models = {m["name"]: m for m in models_of(RENDERS["gpu"])}
    [embedder] = [m for m in models.values() if m.get("task") == "embed"]
    container = worker_pod(objs, embedder)["containers"][0]
    assert env_of(container)["INFERQ_MODEL_TASK"]["value"] == "embed"
    others = [m for m in models.values() if m is not embedder]
    for model in others:
        worker = env_of(worker_pod(objs, model)["containers"][0])
        assert "INFERQ_MODEL_TASK" not in worker  # unset: vLLM's own resolution (auto)
    for name, pod in pod_specs(objs):
        for c in pod["containers"]:
            tasks = json.loads(env_of(c)["INFERQ_MODEL_TASKS"]["value"])
            assert tasks == {embedder["servedModelName"]: "embed"}, name


# --- where files live (docs/files.md) -----------------------------------------------------------


def files_env(objs: list[Obj]) -> dict[str, dict[str, Obj]]:
    """Deployment name -> the files settings of its first container."""
    out = {}
    for name, spec in pod_specs(objs):
        env = env_of(spec["containers"][0])
        out[name] = {k: v for k, v in env.items() if k.startswith(("INFERQ_FILES", "INFERQ_BATCH"))}
    return out


def test_files_in_a_bucket_reach_the_api_and_the_ops_worker_only(
    renders: dict[str, list[Obj]],
) -> None:
    objs = renders["bucket"]
    assert of_kind(objs, "PersistentVolumeClaim") == []
    for name in (f"{RELEASE}-api", f"{RELEASE}-ops"):
        spec = dict(pod_specs(objs))[name]
        container = spec["containers"][0]
        env = env_of(container)
        assert env["INFERQ_FILES_URL"]["value"] == "s3://inferq-files/prod"
        assert env["INFERQ_FILES_ENDPOINT"]["value"] == "https://s3.example.internal"
        assert env["INFERQ_BATCHES_ENABLED"]["value"] == "true"
        assert "INFERQ_FILES_DIR" not in env
        assert container["envFrom"] == [{"secretRef": {"name": "inferq-s3"}}]
        assert "files" not in [v["name"] for v in spec["volumes"]]
    for name, spec in pod_specs(objs):
        if "-worker-" in name:
            assert "INFERQ_FILES_URL" not in env_of(spec["containers"][0])
            assert "envFrom" not in spec["containers"][0]


def test_files_on_a_claim_are_mounted_by_the_api_and_the_ops_worker(
    renders: dict[str, list[Obj]],
) -> None:
    specs = dict(pod_specs(renders["gpu"]))
    for name in (f"{RELEASE}-api", f"{RELEASE}-ops"):
        spec = specs[name]
        assert env_of(spec["containers"][0])["INFERQ_FILES_DIR"]["value"] == "/files"
        (volume,) = [v for v in spec["volumes"] if v["name"] == "files"]
        assert volume["persistentVolumeClaim"]["claimName"] == "inferq-files"


def test_batches_off_need_no_place_for_files(helm: list[str]) -> None:
    objs = objects(template(helm, "--set", "batches.enabled=false"))
    assert of_kind(objs, "PersistentVolumeClaim") == []
    for name, spec in pod_specs(objs):
        assert "files" not in [v["name"] for v in spec["volumes"]], name
        if name in (f"{RELEASE}-api", f"{RELEASE}-ops"):
            env = env_of(spec["containers"][0])
            assert env["INFERQ_BATCHES_ENABLED"]["value"] == "false"
            assert "INFERQ_FILES_URL" not in env and "INFERQ_FILES_DIR" not in env
    # No store to share: the API scales as with a bucket.
    assert len(of_kind(objs, "HorizontalPodAutoscaler")) == 1


# --- the embedded file store: the defaults install (issue 63) ----------------------------------

CLAIM = f"{RELEASE}-files"
# The processes that read and write files' bytes (app/api: uploads and downloads; app/batches'
# validation and finalize in the ops workers); no other pod may mount the claim.
FILES_USERS = {f"{RELEASE}-api", f"{RELEASE}-ops", f"{RELEASE}-ops-extra"}


def test_the_defaults_lint_and_render_with_no_values_at_all(helm: list[str]) -> None:
    """What chart-testing and a first `helm install` do: nothing set, not even a namespace."""
    for command in (
        [*helm, "lint", str(CHART)],
        [*helm, "lint", "--strict", str(CHART)],
        [*helm, "template", "x", str(CHART)],
    ):
        done = run(command)
        assert done.returncode == 0, (command, done.stdout + done.stderr)
        assert "allOf" not in done.stdout + done.stderr


def test_the_defaults_keep_files_on_the_embedded_claim_where_they_are_read_and_written(
    helm: list[str], renders: dict[str, list[Obj]]
) -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())["files"]["embedded"]
    (claim,) = of_kind(renders["default"], "PersistentVolumeClaim")
    assert claim["metadata"]["name"] == CLAIM
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert claim["spec"]["resources"]["requests"]["storage"] == values["size"]
    assert "storageClassName" not in claim["spec"]  # empty: the cluster's default class
    # Batch files are data: `helm uninstall` leaves the claim.
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    # One API replica: the claim is ReadWriteOnce, mounted on one node.
    assert named(renders["default"], "Deployment", "api")["spec"]["replicas"] == 1
    # ops.extraReplicas: the ops workers without beat run batch validation too.
    objs = objects(template(helm, "--set", "ops.extraReplicas=2", "--set", "dispatcher.replicas=1"))
    specs = {
        o["metadata"]["name"]: o["spec"]["template"]
        for o in objs
        if o["kind"] in ("Deployment", "Job")
    }
    assert FILES_USERS | {f"{RELEASE}-dispatcher", f"{RELEASE}-migrate"} <= set(specs)
    users = {}
    for name, pod in specs.items():
        spec = pod["spec"]
        container = spec["containers"][0]
        env = env_of(container)
        claims = [v for v in spec["volumes"] if "persistentVolumeClaim" in v]
        if name not in FILES_USERS:
            assert claims == [] and "INFERQ_FILES_DIR" not in env, name
            continue
        (volume,) = claims
        assert volume == {"name": "files", "persistentVolumeClaim": {"claimName": CLAIM}}, name
        assert {"name": "files", "mountPath": "/files"} in container["volumeMounts"], name
        assert env["INFERQ_FILES_DIR"]["value"] == "/files", name
        assert "INFERQ_FILES_URL" not in env, name
        users[name] = pod
    assert set(users) == FILES_USERS
    # A ReadWriteOnce claim is mounted on one node: every pod that mounts it requires to run
    # beside the others (a required pod affinity on the node), and only they carry its label.
    for name, pod in users.items():
        (term,) = pod["spec"]["affinity"]["podAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]
        assert term["topologyKey"] == "kubernetes.io/hostname", name
        wanted = term["labelSelector"]["matchLabels"]
        for other, p in specs.items():
            carries = wanted.items() <= p["metadata"]["labels"].items()
            assert carries == (other in FILES_USERS), (name, other)


def test_a_model_s_own_affinity_is_kept_beside_the_claim_s(helm: list[str]) -> None:
    zone = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["cpu"]}]}
                ]
            }
        }
    }
    objs = objects(template(helm, "--set-json", f"api.affinity={json.dumps(zone)}"))
    affinity = named(objs, "Deployment", "api")["spec"]["template"]["spec"]["affinity"]
    assert affinity["nodeAffinity"] == zone["nodeAffinity"]
    assert len(affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]) == 1


def test_a_shared_store_leaves_the_api_autoscaled(renders: dict[str, list[Obj]]) -> None:
    for render in ("bucket", "gpu", "cluster"):
        objs = renders[render]
        assert of_kind(objs, "PersistentVolumeClaim") == [], render
        assert "replicas" not in named(objs, "Deployment", "api")["spec"], render
        hpa = named(objs, "HorizontalPodAutoscaler", "api")["spec"]
        assert (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 10), render
        for name, spec in pod_specs(objs):
            assert "podAffinity" not in spec.get("affinity", {}), (render, name)


def test_a_shared_store_takes_a_fixed_replica_count(helm: list[str]) -> None:
    objs = objects(template(helm, "-f", str(S3_VALUES), "--set", "api.autoscaling.enabled=false"))
    assert named(objs, "Deployment", "api")["spec"]["replicas"] == 2
    assert of_kind(objs, "HorizontalPodAutoscaler") == []
    objs = objects(template(helm, "--set", "api.autoscaling.enabled=false"))
    assert named(objs, "Deployment", "api")["spec"]["replicas"] == 1


# Values set wrongly, and what the sentence that refuses them says: what is wrong, what to set.
WRONG = [
    (
        ["--set", "api.replicas=3"],
        [
            "api.replicas=3: the embedded file store serves one API replica",
            "set files.url (s3://bucket/prefix) or files.existingClaim",
            "or api.replicas=1",
        ],
    ),
    (
        ["--set", "api.autoscaling.enabled=true"],
        [
            "api.autoscaling.enabled=true: the embedded file store serves one API replica",
            "set files.url (s3://bucket/prefix) or files.existingClaim",
            "or api.autoscaling.enabled=false",
        ],
    ),
    (
        ["--set", "files.url=ftp://somewhere"],
        ['files.url "ftp://somewhere"', "s3://bucket/prefix"],
    ),
    (
        ["--set", "files.url=s3://b/p", "--set", "files.existingClaim=shared"],
        ["files.url and files.existingClaim are both set: set one"],
    ),
    (
        ["--set", "ingress.enabled=true"],
        ["ingress.enabled=true needs a host: set ingress.hosts"],
    ),
]


@pytest.mark.parametrize(("args", "sentences"), WRONG)
def test_a_value_set_wrongly_fails_with_a_sentence_not_a_schema_trace(
    helm: list[str], args: list[str], sentences: list[str]
) -> None:
    for done in (template(helm, *args), install(helm, *args)):
        assert done.returncode != 0, done.stdout
        error = " ".join(done.stderr.split())  # the sentence, whatever helm's line breaks
        for sentence in sentences:
            assert sentence in error, done.stderr
        assert "allOf" not in error and "anyOf" not in error, done.stderr
        assert "specifications of the schema" not in error, done.stderr


def test_the_notes_say_where_files_live_and_how_to_move_them_to_a_bucket(
    helm: list[str],
) -> None:
    def notes(done: subprocess.CompletedProcess[str]) -> str:
        assert done.returncode == 0, done.stderr
        return " ".join(done.stdout.split("NOTES:", 1)[1].split())

    embedded = notes(install(helm))
    assert f"the embedded file store: the claim {CLAIM}" in embedded
    assert "serves one API replica" in embedded
    for value in ("files.url=s3://", "files.region=", "files.credentialsSecret="):
        assert value in embedded, value
    bucket = notes(install(helm, "-f", str(S3_VALUES)))
    assert "Batch files live in s3://inferq-files/prod" in bucket
    assert "embedded" not in bucket
    off = notes(install(helm, "--set", "batches.enabled=false"))
    assert "Batches are off" in off and "embedded" not in off


# --- a real cluster's GPU nodes and gated weights (issue 56) ----------------------------------


def test_gpu_workers_tolerate_the_gpu_taint_unless_they_say_otherwise(
    helm: list[str], renders: dict[str, list[Obj]], tmp_path: Path
) -> None:
    taint = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    (model,) = models_of(RENDERS["default"])
    assert worker_pod(renders["default"], model)["tolerations"] == [taint]
    own = tmp_path / "own.yaml"
    models = [
        {**model, "tolerations": []},
        {"name": "cpu", "model": "m", "gpus": {"count": 0}},
    ]
    own.write_text(yaml.safe_dump({"models": models}))
    objs = objects(template(helm, "-f", str(own)))
    for m in models:
        assert "tolerations" not in worker_pod(objs, m), m["name"]


def test_the_hugging_face_token_comes_from_a_secret(helm: list[str]) -> None:
    objs = objects(
        template(helm, "--set", "hfToken.secretName=hf", "--set", "hfToken.secretKey=tok")
    )
    (model,) = models_of([])
    env = env_of(worker_pod(objs, model)["containers"][0])
    assert env["HF_TOKEN"] == {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "hf", "key": "tok"}},
    }
    for name, spec in pod_specs(objs):
        if "-worker-" not in name:
            assert "HF_TOKEN" not in env_of(spec["containers"][0]), name


def test_the_ingress_routes_to_the_api(renders: dict[str, list[Obj]]) -> None:
    assert of_kind(renders["default"], "Ingress") == []
    ingress = named(renders["cluster"], "Ingress", "api")
    (rule,) = ingress["spec"]["rules"]
    backend = rule["http"]["paths"][0]["backend"]["service"]
    assert (rule["host"], backend["name"]) == ("inferq.example.com", f"{RELEASE}-api")
    api = named(renders["cluster"], "Service", "api")
    assert backend["port"]["name"] in [p["name"] for p in api["spec"]["ports"]]
    assert ingress["spec"]["tls"] == [{"secretName": "inferq-tls", "hosts": ["inferq.example.com"]}]


def test_network_policies_cover_every_pod_and_open_only_their_ports(
    renders: dict[str, list[Obj]],
) -> None:
    objs = renders["cluster"]
    assert of_kind(renders["default"], "NetworkPolicy") == []
    policies = of_kind(objs, "NetworkPolicy")

    def selects(policy: Obj, labels: dict[str, str]) -> bool:
        selector = policy["spec"]["podSelector"]
        if any(labels.get(k) != v for k, v in selector["matchLabels"].items()):
            return False
        return all(labels.get(e["key"]) in e["values"] for e in selector["matchExpressions"])

    for o in objs:
        if o["kind"] in ("Deployment", "Job"):
            labels = o["spec"]["template"]["metadata"]["labels"]
            chosen = [p["metadata"]["name"] for p in policies if selects(p, labels)]
            assert len(chosen) == 1, (o["metadata"]["name"], chosen)
    egress = {
        p["metadata"]["name"].removeprefix(f"{RELEASE}-"): {
            port["port"] for rule in p["spec"]["egress"] for port in rule["ports"]
        }
        for p in policies
    }
    assert egress["api"] == egress["internal"] == {53, 5432, 6379, 443}
    assert egress["ops"] == {53, 5432, 6379, 443, 80}  # webhook targets
    api = named(objs, "NetworkPolicy", "api")["spec"]["ingress"]
    assert [p["port"] for rule in api for p in rule["ports"]] == ["http"]


def test_a_first_operator_key_comes_from_a_secret_through_the_environment(
    renders: dict[str, list[Obj]],
) -> None:
    plain = named(renders["default"], "Job", "migrate")["spec"]["template"]["spec"]
    assert plain["containers"][0]["args"] == ["inferq", "migrate"]
    job = named(renders["cluster"], "Job", "migrate")["spec"]["template"]["spec"]
    (container,) = job["containers"]
    assert container["args"] == [
        "inferq",
        "migrate",
        "--operator-key-env",
        "OPERATOR_API_KEY",
        "--operator-tenant",
        "operator",
    ]
    assert env_of(container)["OPERATOR_API_KEY"]["valueFrom"] == {
        "secretKeyRef": {"name": "inferq-operator", "key": "api-key"}
    }


@pytest.mark.parametrize(
    ("args", "where"),
    [
        (["--set", "operatorKey.tenant=a b;rm"], "/operatorKey/tenant"),
        (["--set-json", "networkPolicy.egressPorts=[70000]"], "/networkPolicy/egressPorts/0"),
        (["--set", "hfToken.secretKey="], "/hfToken/secretKey"),
    ],
)
def test_the_new_options_refuse_bad_values_naming_them(
    helm: list[str], args: list[str], where: str
) -> None:
    done = template(helm, *args)
    assert done.returncode != 0 and where in done.stderr, done.stderr
