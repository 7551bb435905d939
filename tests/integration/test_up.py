"""`inferq up`: the whole stack from nothing (no Redis running), then a clean stop."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import psutil
import redis

from app.cli.stack import left_running, port_holder, redis_server_argv
from app.cli.where import RECORD_FILE
from tests.support import REPO, free_port, free_ports_in_a_row, wait_until


def readme_banner() -> str:
    text = (REPO / "README.md").read_text()
    after = text[text.index("`inferq up` prints what it started") :]
    return after[after.index("```\n") + 4 : after.index("\n```", after.index("```\n") + 4)]


def banner_shape(banner: str) -> list[str]:
    """A banner's lines by what they say, not by their values: each setting's label ("API",
    "API key", "metrics", ...) and the fixed lines; continuation lines count as one."""
    shape = []
    for line in banner.splitlines():
        if not line.strip() or line.startswith("            "):
            continue
        if line.startswith("  ") and shape and shape[-1] == "Try:":
            shape.append("<command>")
        elif line.startswith("  "):
            shape.append(re.split(r"\s{2,}", line.strip())[0])
        else:
            shape.append(line.strip())
        if shape[-1] == "Ctrl-C stops everything.":
            break
    return shape


UP = [sys.executable, "-m", "app.cli", "up", "--engine", "simulated"]


def up_env(tmp_path: Path, api_port: int, redis_port: int) -> dict[str, str]:
    """`inferq up`'s environment: its own data directory and API port, and a Redis port where
    nothing listens, so that it starts its own redis-server."""
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("INFERQ_")},
        "PYTHONUNBUFFERED": "1",
        "INFERQ_DATA_DIR": str(tmp_path / "data"),
        "INFERQ_API_PORT": str(api_port),
        "INFERQ_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
    }


def start_up(env: dict[str, str]) -> tuple[subprocess.Popen[str], list[str], threading.Thread]:
    """`inferq up` started and up, with a thread collecting its lines as they come (stopped
    with its children, and the test failed, when it does not come up)."""
    proc = subprocess.Popen(
        UP, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: list[str] = []
    reader = threading.Thread(
        target=lambda: lines.extend(iter(proc.stdout.readline, "")),  # type: ignore[union-attr]
        daemon=True,
    )
    reader.start()
    try:
        wait_until(
            lambda: any("inferq is up" in line for line in lines) or proc.poll(), 120, "inferq up"
        )
        assert proc.poll() is None, "".join(lines)
    except BaseException:
        # `inferq up` may have exited already (then its own stop took its children): the
        # assertion above, with its output, is what the test reports.
        with contextlib.suppress(psutil.NoSuchProcess):
            for leftover in [*psutil.Process(proc.pid).children(recursive=True), proc]:
                with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                    leftover.kill()
        raise
    return proc, lines, reader


def test_up_runs_the_whole_stack_and_stops_every_child(tmp_path: Path) -> None:
    api_port, redis_port, metrics_port = free_port(), free_port(), free_ports_in_a_row(2)
    # With the embedding model's worker beside the demo's (the simulated engine stands in for
    # both) and a fixed /metrics port: the embedding worker takes the next one.
    env = {
        **up_env(tmp_path, api_port, redis_port),
        "INFERQ_UP_EMBEDDING_MODEL": "minilm",
        "INFERQ_WORKER_METRICS_PORT": str(metrics_port),
    }
    proc, lines, reader = start_up(env)
    children: list[psutil.Process] = []
    try:
        output = "".join(lines)
        # The README's sample banner has the lines this one has, in this order.
        wait_until(lambda: any("Ctrl-C stops everything" in line for line in lines), 10, "banner")
        banner = "".join(lines)
        assert banner_shape(banner[banner.index("inferq is up") :]) == banner_shape(readme_banner())
        assert "private redis-server started by inferq" in output
        assert "SIMULATED" in output
        key = re.search(r"API key\s+(iq_\S+)", output).group(1)
        url = re.search(r"API\s+(http://\S+)", output).group(1)
        assert url == f"http://127.0.0.1:{api_port}"
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 3  # redis-server, api, worker
        # The metrics line names the addresses the workers and the ops worker announced, and
        # the API's service discovery lists the same three.
        worker_metrics, embedder_metrics, ops_metrics = re.search(
            r"worker (http://\S+/metrics), embedder (http://\S+/metrics), ops (http://\S+/metrics)",
            output,
        ).groups()
        assert worker_metrics == f"http://127.0.0.1:{metrics_port}/metrics"
        assert embedder_metrics == f"http://127.0.0.1:{metrics_port + 1}/metrics"
        for page in (worker_metrics, embedder_metrics, ops_metrics):
            assert httpx.get(page, timeout=5).status_code == 200
        groups = httpx.get(f"{url}/metrics/targets", timeout=5).json()
        assert {(g["labels"]["role"], f"http://{g['targets'][0]}/metrics") for g in groups} == {
            ("inference", worker_metrics),
            ("inference", embedder_metrics),
            ("ops", ops_metrics),
        }
        data = (tmp_path / "data").resolve()
        assert f"files     local directory {data / 'files'}" in output

        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}) as c:
            ids = [
                c.post(
                    "/v1/jobs", json={"prompt": "hello", "lane": lane, "params": {"max_tokens": 4}}
                ).json()["id"]
                for lane in ("realtime", "standard", "bulk")
            ]
            # Two models: the demo model and its LoRA adapter, on the one worker.
            listed = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
            assert listed["inferq-demo-lora"]["parent"] == "inferq-demo"
            assert listed["inferq-demo-lora"]["ready"] and listed["inferq-demo"]["ready"]
            ids.append(
                c.post("/v1/jobs", json={"prompt": "hello", "model": "inferq-demo-lora"}).json()[
                    "id"
                ]
            )
            assert "models    inferq-demo, inferq-demo-lora (LoRA adapter" in output
            for job_id in ids:
                job = wait_until(
                    lambda j=job_id: (
                        (r := c.get(f"/v1/jobs/{j}").json())["status"] == "succeeded" and r
                    ),
                    30,
                    f"job {job_id}",
                )
                assert job["result"]["text"] and job["result"]["usage"]["total_tokens"] > 0

        # `inferq status` in a second shell, without the stack's environment: it reads the
        # settings `inferq up` keeps beside its data, so it asks the stack's API (with the
        # operator's key `inferq up` keeps there), which read the private Redis, not the
        # default one.
        bare = {k: v for k, v in env.items() if not k.startswith("INFERQ_")}
        shown = subprocess.run(
            [sys.executable, "-m", "app.cli", "status"],
            cwd=REPO,
            env={**bare, "INFERQ_DATA_DIR": str(tmp_path / "data")},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert shown.returncode == 0, shown.stderr
        first = shown.stdout.splitlines()[0]
        assert f": the API at {url}, which read Redis redis://127.0.0.1:{redis_port}/0, " in first
        assert f"database sqlite:///{data}/" in first
        assert f"as the `inferq up` running here (pid {proc.pid})" in first, first
        assert "no worker is announced" not in shown.stdout
        assert "inferq-demo" in shown.stdout and "minilm" in shown.stdout

        # The client commands against the same stack.
        client_env = {**env, "INFERQ_API_URL": url, "INFERQ_API_KEY": key}
        submitted = subprocess.run(
            [
                sys.executable,
                "-m",
                "app.cli",
                "submit",
                "hi there",
                "--chat",
                "--lane",
                "bulk",
                "--max-tokens",
                "3",
                "--wait",
            ],
            cwd=REPO,
            env=client_env,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        job = json.loads(submitted.stdout)
        assert job["status"] == "succeeded" and job["lane"] == "bulk"
        assert job["result"]["usage"]["completion_tokens"] == 3
        got = subprocess.run(
            [sys.executable, "-m", "app.cli", "get", job["id"]],
            cwd=REPO,
            env=client_env,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        assert json.loads(got.stdout) == job

        private = redis.Redis(port=redis_port)
        assert list(private.scan_iter("inferq:limit:*")), "the calls above counted nothing"
        # A supervisor's SIGTERM and a Ctrl-C right behind it: the second signal must not cut
        # the stop short and orphan the children.
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        reader.join(5)
        # The last line says that everything stopped, and how long the stop took.
        assert re.fullmatch(
            r"inferq stopped: redis, api, ops, worker, embedder \(\d+\.\d s\)", lines[-1].strip()
        ), lines[-3:]
        assert not (tmp_path / "data" / RECORD_FILE).exists()  # its own record goes with it
        wait_until(
            lambda: (
                not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children)
            ),
            20,
            "children to exit",
        )
        try:
            redis.Redis(port=redis_port, socket_connect_timeout=0.5).ping()
            raise AssertionError("the private redis-server is still running")
        except redis.ConnectionError:
            pass
        # Its data survives (append-only file), but not the rate-limit windows of this run:
        # they would count against the next one.
        server = subprocess.Popen(
            redis_server_argv("redis-server", redis_port, tmp_path / "data" / "redis"),
            stdout=subprocess.DEVNULL,
        )
        try:
            again = redis.Redis(port=redis_port)
            wait_until(lambda: again.ping(), 10, "the private redis-server, restarted")
            assert again.dbsize() > 0  # the data is there (queues, the model card) ...
            assert list(again.scan_iter("inferq:limit:*")) == []  # ... but no window
        finally:
            server.terminate()
            server.wait(10)
    finally:
        for leftover in [proc, *children]:  # only when the test failed half-way
            with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                leftover.kill()


def test_a_killed_supervisor_leaves_no_child_and_a_second_start_names_what_runs(
    tmp_path: Path,
) -> None:
    """`kill -9` of `inferq up` (a closed terminal, the OOM killer): every child stops within
    seconds, by the parent-death signal each was started with (app/core/processes/lifeline.py).
    Before that, a second `up` on the same data directory, and one on the same API port, refuse to
    start and name the processes in the way."""
    api_port, redis_port = free_port(), free_port()
    env = up_env(tmp_path, api_port, redis_port)
    proc, _, _ = start_up(env)
    children: list[psutil.Process] = []
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
        named = {c.pid for c in children}
        assert len(children) >= 4, children  # redis-server, api, ops, worker

        again = subprocess.run(UP, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
        assert again.returncode == 1, again.stdout + again.stderr
        said = again.stdout
        assert "an earlier `inferq up`" in said and f"up (pid {proc.pid})" in said, said
        assert {int(p) for p in re.findall(r"\(pid (\d+)\)", said)} - {proc.pid} <= named, said
        assert f"kill {proc.pid}" in said, said
        # Another data directory, the same API port: the port's holder is named.
        other = {**env, "INFERQ_DATA_DIR": str(tmp_path / "other")}
        held = subprocess.run(UP, cwd=REPO, env=other, capture_output=True, text=True, timeout=60)
        assert held.returncode == 1, held.stdout + held.stderr
        assert f"port 127.0.0.1:{api_port} (INFERQ_API_PORT) is held by pid" in held.stdout, (
            held.stdout
        )
        holder = int(re.search(r"held by pid (\d+)", held.stdout).group(1))
        assert holder in named, (holder, named)

        proc.kill()
        proc.wait(10)
        wait_until(
            lambda: (
                not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children)
            ),
            20,
            "every child of the killed supervisor to stop",
        )
        assert port_holder("127.0.0.1", api_port) is None
        assert left_running(tmp_path / "data" / RECORD_FILE) == []
    finally:
        for leftover in [proc, *children]:  # only when the test failed half-way
            with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                leftover.kill()


# In this module, not test_status.py: `inferq status` run outside a stack names the `inferq up`
# supervisors it finds on the machine, and under xdist (--dist loadfile) only the tests of one
# module never run beside each other.
def test_status_where_no_stack_ran_creates_nothing_and_says_where_it_looked(
    tmp_path: Path,
) -> None:
    """Outside the checkout (no ./.inferq): one line naming the file it looked for; no
    database, no directory left behind. An explicit SQLite URL to no file: the same."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERQ_")}
    # No API at the address it asks first (the default one could be a stack another test, or
    # the machine's user, runs: the command would show that one's status).
    env["INFERQ_API_URL"] = "http://127.0.0.1:9"
    argv = [sys.executable, "-m", "app.cli", "status"]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == ""
    looked = tmp_path.resolve() / ".inferq" / "inferq.db"
    assert done.stderr.startswith(f"inferq status: no inferq database at {looked} "), done.stderr
    assert "INFERQ_DATA_DIR '.inferq'" in done.stderr and len(done.stderr.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []
    url = f"sqlite:///{tmp_path / 'nowhere' / 'x.db'}"
    done = subprocess.run(
        argv,
        cwd=tmp_path,
        env={**env, "INFERQ_DATABASE_URL": url},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and "(INFERQ_DATABASE_URL). Nothing was created." in done.stderr
    assert list(tmp_path.iterdir()) == []
