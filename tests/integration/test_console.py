"""The console (/console) in a real browser: Debian's chromium driven by chromium-driver through
Selenium, against a real stack (API, dispatcher, ops worker and a SIMULATED engine worker) on
loopback, with every other host unresolvable in the browser (the console loads nothing from
elsewhere). Sign-in, live pages, the actions, a batch's progress and files, tenant isolation
and CSRF (docs/console.md). Set INFERQ_CONSOLE_SHOTS to a folder to keep the screenshots the
tests take (docs/console.md shows them).
"""

from __future__ import annotations

import contextlib
import http.server
import io
import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.core.models import TERMINAL
from app.core.settings import DEMO_MODEL_NAME
from tests.conftest import PostgresDatabases, fresh_redis_url
from tests.support import Receiver, Stack, wait_for_job, wait_until

webdriver = pytest.importorskip("selenium.webdriver", reason="install the [dev] extra")
from selenium.common.exceptions import (  # noqa: E402
    NoSuchElementException,
    StaleElementReferenceException,
    WebDriverException,
)
from selenium.webdriver.common.by import By  # noqa: E402

BROWSER = shutil.which("chromium")
DRIVER = shutil.which("chromedriver")
if not (BROWSER and DRIVER):
    if os.environ.get("INFERQ_TEST_REQUIRE_BROWSER") == "1":
        raise RuntimeError("chromium and chromium-driver are required (.ci/run installs them)")
    pytest.skip("no chromium/chromium-driver here (.ci/run installs them)", allow_module_level=True)

LINES = 50


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, postgres: PostgresDatabases) -> Iterator[Stack]:
    """On PostgreSQL, keys on; tenants acme and globex and an operator. No inference worker
    yet: the first test watches a job wait for one (``worker`` starts it)."""
    tmp: Path = tmp_path_factory.mktemp("console")
    s = Stack(
        tmp,
        postgres.create(),
        fresh_redis_url(),
        require_auth="true",
        webhook_allow_private="true",
        webhook_retry_schedule="0.3",
        webhook_sweep_interval_s=0.2,
        batch_sweep_interval_s=0.5,
    )
    s.migrate()
    s.keys = {}  # type: ignore[attr-defined]
    for tenant, *extra in (("acme",), ("globex", "--weight", "3"), ("ops", "--admin")):
        made = s.cli("keys", "create", "--tenant", tenant, *extra)
        assert made.returncode == 0, made.stderr
        s.keys[tenant] = made.stdout.strip()  # type: ignore[attr-defined]
    s.api_key = s.keys["acme"]  # type: ignore[attr-defined]
    s.start_api()
    s.start_ops()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def worker(stack: Stack) -> Stack:
    """The stack with its SIMULATED worker (started once; time slowed so a job runs a while)."""
    if not any(p.name.startswith("worker") for p in stack.procs):
        stack.start_worker(sim_time_scale=1.0)
    return stack


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    downloads = tmp_path_factory.mktemp("downloads")
    options = webdriver.ChromeOptions()
    options.binary_location = BROWSER
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--window-size=1360,1000",
        # Every host but loopback unresolvable: a page that needed anything from elsewhere
        # would break here.
        "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
    ):
        options.add_argument(argument)
    options.add_experimental_option(
        "prefs",
        {"download.default_directory": str(downloads), "download.prompt_for_download": False},
    )
    driver = webdriver.Chrome(service=webdriver.ChromeService(DRIVER), options=options)
    driver.downloads = downloads
    try:
        yield driver
    finally:
        driver.quit()


def shot(driver: Any, name: str) -> None:
    """A screenshot (kept where INFERQ_CONSOLE_SHOTS says; docs/console.md shows them)."""
    folder = os.environ.get("INFERQ_CONSOLE_SHOTS")
    png = driver.get_screenshot_as_png()
    assert png.startswith(b"\x89PNG")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"console-{name}.png").write_bytes(png)


def sign_in(driver: Any, stack: Stack, tenant: str) -> None:
    driver.delete_all_cookies()
    driver.get(f"{stack.url}/console/login")
    driver.find_element(By.ID, "key").send_keys(stack.keys[tenant])  # type: ignore[attr-defined]
    driver.find_element(By.CSS_SELECTOR, "form.login button").click()
    wait_until(
        lambda: driver.current_url == f"{stack.url}/console" and text_of(driver, "#who"),
        10,
        "the overview",
    )


def click(driver: Any, css: str) -> None:
    """Click the element ``css`` finds; again if the page's live part replaced it meanwhile."""
    for _ in range(20):
        try:
            driver.find_element(By.CSS_SELECTOR, css).click()
            return
        except (StaleElementReferenceException, NoSuchElementException):
            time.sleep(0.1)
    raise AssertionError(f"could not click {css}")


def attribute(driver: Any, css: str, name: str) -> str | None:
    """An attribute of the element ``css`` finds, read in one step in the page (None: none)."""
    found = driver.execute_script(
        "const e = document.querySelector(arguments[0]); "
        "return e ? e.getAttribute(arguments[1]) : null",
        css,
        name,
    )
    return None if found is None else str(found)


def text_of(driver: Any, css: str) -> str:
    try:
        return str(driver.find_element(By.CSS_SELECTOR, css).text)
    except WebDriverException:
        return ""


def api(stack: Stack, tenant: str) -> httpx.Client:
    key = stack.keys[tenant]  # type: ignore[attr-defined]
    return httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {key}"}, timeout=30)


@contextlib.contextmanager
def console_client(stack: Stack, tenant: str) -> Iterator[httpx.Client]:
    """An HTTP client signed in to the console as ``tenant`` (its session cookie, no key)."""
    with httpx.Client(base_url=stack.url, timeout=30) as c:
        key = stack.keys[tenant]  # type: ignore[attr-defined]
        signed = c.post("/console/login", data={"key": key})
        assert signed.status_code == 303 and signed.headers["location"] == "/console"
        yield c


def csrf_of(page: str) -> str:
    marker = 'name="csrf" value="'
    start = page.index(marker) + len(marker)
    return page[start : page.index('"', start)]


def test_sign_in_then_watch_a_job_go_queued_running_succeeded_without_a_reload(
    stack: Stack, browser: Any
) -> None:
    browser.get(f"{stack.url}/console")
    assert browser.current_url == f"{stack.url}/console/login"  # nobody signed in
    browser.find_element(By.ID, "key").send_keys("iq_not-a-key")
    browser.find_element(By.CSS_SELECTOR, "form.login button").click()
    wait_until(lambda: "invalid or revoked" in text_of(browser, "#login-error"), 10, "the refusal")
    sign_in(browser, stack, "acme")
    assert text_of(browser, "#who") == "tenant acme"
    assert "no inference worker is alive" in text_of(browser, "#parts")
    job = stack.submit({"prompt": "watch me", "lane": "standard", "params": {"max_tokens": 400}})
    # The overview, live: the job waits for a worker of its model, and the page says so in red.
    wait_until(lambda: "no worker serves it" in text_of(browser, "#missing"), 20, "missing")
    color = browser.execute_script(
        "return getComputedStyle(document.querySelector('#missing li')).color"
    )
    assert color in (
        "rgba(201, 42, 42, 1)",
        "rgb(201, 42, 42)",
    )
    browser.get(f"{stack.url}/console/jobs")
    browser.execute_script("window.notReloaded = true")
    row = f"#row-{job['id']} .status"
    wait_until(lambda: text_of(browser, row) == "queued", 20, "the row, queued")
    worker = stack.start_worker(sim_time_scale=1.0)
    assert worker.alive()
    seen = ["queued"]

    def ended() -> bool:
        status = text_of(browser, row)
        if status and status != seen[-1]:
            seen.append(status)
        return status == "succeeded"

    wait_until(ended, 60, "the row to reach succeeded", every=0.1)
    assert seen == ["queued", "running", "succeeded"]
    assert browser.execute_script("return window.notReloaded") is True
    as_of = text_of(browser, "#as-of")
    assert as_of.endswith("UTC")


def test_a_running_job_is_cancelled_from_its_page(worker: Stack, browser: Any) -> None:
    sign_in(browser, worker, "acme")
    job = worker.submit(
        {"prompt": "a long one", "lane": "realtime", "params": {"max_tokens": 8000}}
    )
    browser.get(f"{worker.url}/console/jobs/{job['id']}")
    wait_until(lambda: text_of(browser, "#status") == "running", 30, "the job to run")
    wait_until(
        lambda: len(browser.find_elements(By.CSS_SELECTOR, "#timeline rect")) >= 2, 10, "a timeline"
    )
    shot(browser, "job-running")
    click(browser, "#cancel")
    wait_until(lambda: text_of(browser, "#status") == "cancelled", 30, "the page to say cancelled")
    with api(worker, "acme") as c:
        assert c.get(f"/v1/jobs/{job['id']}").json()["status"] == "cancelled"


def test_a_webhook_is_redelivered_from_the_job_page(
    worker: Stack, browser: Any, receiver: Receiver
) -> None:
    sign_in(browser, worker, "acme")
    url = receiver.url("/ok", host="127.0.0.1")
    job = worker.submit({"prompt": "hook me", "lane": "realtime", "webhook_url": url})
    browser.get(f"{worker.url}/console/jobs/{job['id']}")
    rows = "#deliveries tbody tr.ok"
    wait_until(lambda: len(browser.find_elements(By.CSS_SELECTOR, rows)) == 1, 30, "attempt 1")
    assert len(receiver.received("/ok")) >= 1
    shot(browser, "job")
    click(browser, "#redeliver")
    wait_until(lambda: len(browser.find_elements(By.CSS_SELECTOR, rows)) == 2, 30, "attempt 2")
    assert "redelivery" in text_of(browser, "#deliveries")


def test_a_batch_shows_its_progress_and_its_output_downloads(worker: Stack, browser: Any) -> None:
    sign_in(browser, worker, "acme")
    # Lines of different lengths end one after another: the bar moves in steps.
    lines = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": DEMO_MODEL_NAME, "prompt": f"line {i}", "max_tokens": 50 + 20 * i},
        }
        for i in range(LINES)
    ]
    data = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
    with api(worker, "acme") as c:
        uploaded = c.post(
            "/v1/files", files={"file": ("in.jsonl", io.BytesIO(data))}, data={"purpose": "batch"}
        )
        assert uploaded.status_code == 200, uploaded.text
        made = c.post(
            "/v1/batches",
            json={
                "input_file_id": uploaded.json()["id"],
                "endpoint": "/v1/completions",
                "completion_window": "24h",
            },
        )
        assert made.status_code == 200, made.text
        batch_id = made.json()["id"]
    browser.get(f"{worker.url}/console/batches")
    counts = f"#batch-{batch_id} .counts"

    def done() -> int:
        cell = attribute(browser, counts, "data-completed")
        return int(cell) if cell is not None else -1

    progress = [done()]
    while progress[-1] < LINES:
        time.sleep(0.2)
        progress.append(done())
        if 0 < progress[-1] < LINES and not any(0 < p < LINES for p in progress[:-1]):
            shot(browser, "batch")
        assert len(progress) < 600, progress
    assert any(0 < p < LINES for p in progress), "the bar moved in steps"
    wait_until(
        lambda: text_of(browser, f"#batch-{batch_id} .status") == "completed", 30, "completed"
    )
    output = f"#batch-{batch_id} a.file-output"
    href = wait_until(lambda: attribute(browser, output, "href"), 10, "the output link")
    file_id = href.rsplit("/", 1)[1]
    click(browser, output)
    downloads: Path = browser.downloads
    found = wait_until(
        lambda: [p for p in downloads.iterdir() if not p.name.endswith(".crdownload")],
        30,
        "the download",
    )
    with api(worker, "acme") as c:
        served = c.get(f"/v1/files/{file_id}/content")
    assert served.status_code == 200
    assert found[0].read_bytes() == served.content
    assert len(served.content.splitlines()) == LINES


def test_the_operator_sees_every_tenant_and_their_fair_share(worker: Stack, browser: Any) -> None:
    with api(worker, "globex") as c:
        ids = [
            c.post(
                "/v1/jobs", json={"prompt": f"g{i}", "lane": "bulk", "params": {"max_tokens": 30}}
            ).json()["id"]
            for i in range(20)
        ]
    with api(worker, "acme") as c:
        for i in range(20):
            c.post(
                "/v1/jobs", json={"prompt": f"a{i}", "lane": "bulk", "params": {"max_tokens": 30}}
            )
    sign_in(browser, worker, "ops")
    assert text_of(browser, "#who") == "operator (every tenant)"
    wait_until(lambda: browser.find_elements(By.CSS_SELECTOR, "#throughput rect"), 30, "bars")
    shot(browser, "overview")
    browser.get(f"{worker.url}/console/jobs?tenant=globex")
    wait_until(lambda: browser.find_elements(By.ID, f"row-{ids[-1]}"), 10, "globex's job")
    assert "acme" not in text_of(browser, "#jobs tbody")
    with api(worker, "globex") as c:
        wait_for_job(c, ids[-1], 60, TERMINAL, worker.procs)
    browser.get(f"{worker.url}/console/tenants")
    tenants = text_of(browser, "#tenants")
    assert "acme" in tenants and "globex" in tenants
    assert text_of(browser, "#tenant-globex td:nth-child(2)") == "3"  # its weight
    assert text_of(browser, "#tenant-globex td:last-child") == "1"  # its keys
    shot(browser, "tenants")


def test_a_tenant_reaches_nothing_of_another_by_any_url(worker: Stack, browser: Any) -> None:
    with api(worker, "acme") as c:
        job = c.post("/v1/jobs", json={"prompt": "mine", "metadata": {"team": "red"}}).json()
        line = {
            "custom_id": "x",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": DEMO_MODEL_NAME, "prompt": "x", "max_tokens": 8000},
        }
        upload = c.post(
            "/v1/files",
            files={"file": ("x.jsonl", io.BytesIO(json.dumps(line).encode() + b"\n"))},
            data={"purpose": "batch"},
        ).json()
        batch = c.post(
            "/v1/batches",
            json={
                "input_file_id": upload["id"],
                "endpoint": "/v1/completions",
                "completion_window": "24h",
            },
        ).json()
    # In the browser: another tenant's job is "not found", its batch is not listed.
    sign_in(browser, worker, "globex")
    browser.get(f"{worker.url}/console/jobs/{job['id']}")
    assert "job_not_found" in text_of(browser, "h1")
    browser.get(f"{worker.url}/console/batches")
    assert batch["id"] not in text_of(browser, "#batches")
    with console_client(worker, "globex") as theirs:
        for path in (
            f"/console/jobs/{job['id']}",
            f"/console/jobs/{job['id']}?live=1",
            f"/console/files/{upload['id']}",
            "/console/tenants",
        ):
            assert theirs.get(path).status_code == 404, path
        in_batch = theirs.get("/console/jobs", params={"batch": batch["id"]}).text
        assert "no jobs" in in_batch
        listed = theirs.get("/console/jobs", params={"tenant": "acme", "q": job["id"]}).text
        assert f'id="row-{job["id"]}"' not in listed and "no jobs" in listed
        assert "acme" not in theirs.get("/console/batches").text
        page = theirs.get("/console").text
        token = csrf_of(page)
        for action in (
            f"/console/jobs/{job['id']}/cancel",
            f"/console/jobs/{job['id']}/redeliver",
            f"/console/batches/{batch['id']}/cancel",
        ):
            assert theirs.post(action, data={"csrf": token}).status_code == 404, action
    with console_client(worker, "acme") as mine:
        found = mine.get("/console/jobs", params={"q": "red"}).text
        assert f'id="row-{job["id"]}"' in found  # searched by its metadata


def test_actions_need_the_sessions_csrf_token_and_pages_their_policy(
    worker: Stack, browser: Any
) -> None:
    with api(worker, "acme") as c:
        job = c.post(
            "/v1/jobs", json={"prompt": "x", "lane": "bulk", "params": {"max_tokens": 8000}}
        ).json()
    # A forged action in the browser: a page of another origin (another port of this host,
    # the same site, so the session's cookie goes along) posts the cancel with a guessed token.
    sign_in(browser, worker, "acme")
    action = f"{worker.url}/console/jobs/{job['id']}/cancel"
    forgery = (
        f'<form id="f" method="post" action="{action}"><input name="csrf" value="guess"></form>'
        '<script>document.getElementById("f").submit()</script>'
    ).encode()

    class Forger(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("content-type", "text/html")
            self.send_header("content-length", str(len(forgery)))
            self.end_headers()
            self.wfile.write(forgery)

        def log_message(self, *_: Any) -> None:
            pass

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Forger) as site:
        threading.Thread(target=site.serve_forever, daemon=True).start()
        browser.get(f"http://127.0.0.1:{site.server_address[1]}/")
        wait_until(lambda: "csrf_failed" in text_of(browser, "h1"), 10, "the refusal")
        site.shutdown()
    with console_client(worker, "acme") as mine:
        page = mine.get(f"/console/jobs/{job['id']}")
        policy = page.headers["content-security-policy"]
        assert "script-src 'self'" in policy and "unsafe-inline" not in policy
        assert "frame-ancestors 'none'" in policy
        cookie = page.request.headers.get("cookie", "")
        assert "iq_" not in cookie and worker.keys["acme"] not in page.text  # type: ignore[attr-defined]
        forged = mine.post(f"/console/jobs/{job['id']}/cancel", data={"csrf": "forged"})
        assert forged.status_code == 403
        bare = mine.post(f"/console/jobs/{job['id']}/cancel")
        assert bare.status_code == 403
        with api(worker, "acme") as c:
            assert c.get(f"/v1/jobs/{job['id']}").json()["status"] in ("queued", "running")
        done = mine.post(f"/console/jobs/{job['id']}/cancel", data={"csrf": csrf_of(page.text)})
        assert done.status_code == 303
    set_cookie = (
        httpx.post(
            f"{worker.url}/console/login",
            data={"key": worker.keys["acme"]},  # type: ignore[attr-defined]
        )
        .headers["set-cookie"]
        .lower()
    )
    assert "httponly" in set_cookie and "samesite=strict" in set_cookie
    with api(worker, "acme") as c:
        assert wait_until(
            lambda: c.get(f"/v1/jobs/{job['id']}").json()["status"] == "cancelled",
            30,
            "the cancel",
        )
