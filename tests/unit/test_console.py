"""The console's sign-in and scope, in process (the browser tests are
tests/integration/test_console.py): keys off signs in as the operator at the first page; with
keys on, only a live key signs in, an operator's key sees every tenant and a tenant's only its
own, a revoked key's session ends at its next page, and an action needs the session's CSRF
token."""

from __future__ import annotations

import httpx
import pytest

from app.core.db import session_scope
from app.core.messaging import clients
from app.core.settings import Settings, get_settings
from app.core.tenants.keys import create_key, revoke_key
from tests.unit.inprocess import run

JOB = {"prompt": "Hello", "params": {"max_tokens": 4}}


def csrf_of(page: str) -> str:
    marker = 'name="csrf" value="'
    start = page.index(marker) + len(marker)
    return page[start : page.index('"', start)]


def test_with_keys_off_the_first_page_signs_in_as_the_operator(core: Settings) -> None:
    async def scenario(client: httpx.AsyncClient) -> tuple[httpx.Response, httpx.Response]:
        job = (await client.post("/v1/jobs", json=JOB)).json()
        first = await client.get("/console/jobs")
        again = await client.get(f"/console/jobs/{job['id']}")
        return first, again

    first, again = run(scenario)
    assert first.status_code == 200 and "operator (every tenant)" in first.text
    cookie = first.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie and "path=/console" in cookie
    assert again.status_code == 200 and "set-cookie" not in again.headers  # the same session
    assert "script-src 'self'" in first.headers["content-security-policy"]


def test_keys_decide_what_a_session_sees_and_revoking_ends_it(
    core: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INFERQ_REQUIRE_AUTH", "true")
    get_settings.cache_clear()
    with session_scope() as session:
        acme, acme_key = create_key(session, "acme")
        _, ops_key = create_key(session, "ops", operator=True)
        _, globex_key = create_key(session, "globex")

    async def scenario(client: httpx.AsyncClient) -> dict[str, object]:
        seen: dict[str, object] = {}
        seen["anonymous"] = (await client.get("/console")).status_code
        seen["anonymous live"] = (await client.get("/console?live=1")).status_code
        bad = await client.post("/console/login", data={"key": "iq_wrong"})
        seen["bad key"] = bad.status_code
        headers = {"Authorization": f"Bearer {globex_key}"}
        job = (await client.post("/v1/jobs", json=JOB, headers=headers)).json()
        signed = await client.post("/console/login", data={"key": acme_key})
        seen["signed in"] = (signed.status_code, signed.headers["location"])
        seen["acme reads globex's job"] = (
            await client.get(f"/console/jobs/{job['id']}")
        ).status_code
        seen["acme's tenants page"] = (await client.get("/console/tenants")).status_code
        page = (await client.get("/console")).text
        cancel = f"/console/jobs/{job['id']}/cancel"
        seen["acme cancels globex's job"] = (
            await client.post(cancel, data={"csrf": csrf_of(page)})
        ).status_code
        with session_scope() as session:
            revoke_key(session, acme.id)
        seen["after revoking"] = (await client.get("/console")).status_code
        client.cookies.clear()
        await client.post("/console/login", data={"key": ops_key})
        seen["operator reads globex's job"] = (
            await client.get(f"/console/jobs/{job['id']}")
        ).status_code
        seen["forged"] = (await client.post(cancel, data={"csrf": "forged"})).status_code
        token = csrf_of((await client.get("/console")).text)
        seen["operator cancels"] = (await client.post(cancel, data={"csrf": token})).status_code
        seen["status"] = (await client.get(f"/v1/jobs/{job['id']}", headers=headers)).json()[
            "status"
        ]
        return seen

    assert run(scenario) == {
        "anonymous": 303,
        "anonymous live": 401,
        "bad key": 401,
        "signed in": (303, "/console"),
        "acme reads globex's job": 404,
        "acme's tenants page": 404,
        "acme cancels globex's job": 404,
        "after revoking": 303,
        "operator reads globex's job": 200,
        "forged": 403,
        "operator cancels": 303,
        "status": "cancelled",
    }


def test_the_jobs_page_pages_like_the_api_and_filters(core: Settings) -> None:
    async def scenario(client: httpx.AsyncClient) -> tuple[list[str], str, str, str]:
        ids: list[str] = []
        for i in range(30):
            lane = "bulk" if i % 3 == 0 else "standard"
            body = {**JOB, "lane": lane, "metadata": {"n": f"item-{i}"}}
            ids.append((await client.post("/v1/jobs", json=body)).json()["id"])
        first = (await client.get("/console/jobs")).text
        marker = 'id="next" href="'
        start = first.index(marker) + len(marker)
        second = (await client.get(first[start : first.index('"', start)])).text
        bulk = (await client.get("/console/jobs", params={"lane": "bulk"})).text
        return ids, first, second, bulk

    ids, first, second, bulk = run(scenario)
    on_first = {i for i in ids if f'id="row-{i}"' in first}
    on_second = {i for i in ids if f'id="row-{i}"' in second}
    assert len(on_first) == 25 and ids[-1] in on_first  # newest first
    assert on_first | on_second == set(ids) and not on_first & on_second  # each once
    assert sum(f'id="row-{i}"' in bulk for i in ids) == 10


def test_a_search_reads_a_window_of_the_newest_jobs_and_links_the_older_ones(
    core: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A text that only old jobs have is not looked for through the whole history at once:
    the page says how many jobs it searched and links the next window, where it is found."""
    monkeypatch.setenv("INFERQ_CONSOLE_SEARCH_WINDOW", "5")
    get_settings.cache_clear()

    async def scenario(client: httpx.AsyncClient) -> tuple[list[str], list[str]]:
        ids = []
        for i in range(10):
            tag = "needle" if i < 2 else "hay"
            body = {**JOB, "metadata": {"tag": f"{tag}-{i}"}}
            ids.append((await client.post("/v1/jobs", json=body)).json()["id"])
        pages = [(await client.get("/console/jobs", params={"q": "needle"})).text]
        marker = 'id="older" href="'
        while marker in pages[-1] and len(pages) < 5:
            start = pages[-1].index(marker) + len(marker)
            link = pages[-1][start : pages[-1].index('"', start)].replace("&amp;", "&")
            pages.append((await client.get(link)).text)
        return ids, pages

    ids, pages = run(scenario)
    # Newest 5 (ids 9..5): none; the next 5 (4..0), the last jobs there are: both, and no
    # link to a window below them, which would be empty.
    assert len(pages) == 2, [("searched the 5 newest" in p) for p in pages]
    assert "no jobs" in pages[0] and "searched the 5 newest jobs" in pages[0]
    assert [i for i in ids if f'id="row-{i}"' in pages[1]] == ids[:2]
    assert 'id="older"' not in pages[1] and 'id="next"' not in pages[1]


def test_the_tenants_page_shows_what_each_tenant_used_of_its_limits(
    core: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INFERQ_REQUIRE_AUTH", "true")
    monkeypatch.setenv("INFERQ_LIMIT_WINDOW_S", "86400")  # one window for the whole test
    get_settings.cache_clear()
    with session_scope() as session:
        _, acme_key = create_key(session, "acme", requests_per_minute=50, weight=2)
        _, ops_key = create_key(session, "ops", operator=True)

    async def scenario(client: httpx.AsyncClient) -> str:
        for _ in range(3):
            headers = {"Authorization": f"Bearer {acme_key}"}
            assert (await client.post("/v1/jobs", json=JOB, headers=headers)).status_code == 202
        await client.post("/console/login", data={"key": ops_key})
        return (await client.get("/console/tenants?live=1")).text

    page = run(scenario)
    row = page[page.index('id="tenant-acme"') :]
    row = row[: row.index("</tr>")]
    assert "3 / 50 requests" in row  # used of its limit in this window
    assert f"3 / {get_settings().tenant_max_queued}</td>" in row  # waiting, of its bound
    assert '<td class="num">2</td>' in row  # its weight


def test_with_redis_away_the_console_answers_503_not_500(
    core: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sessions live in Redis: while it is away every page, the sign-in and an action are a
    503 page naming it, not a 500."""
    with session_scope() as session:
        _, acme_key = create_key(session, "acme")
    monkeypatch.setenv("INFERQ_REQUIRE_AUTH", "true")
    monkeypatch.setenv("INFERQ_REDIS_URL", "redis://127.0.0.1:1/0")  # nothing listens there
    monkeypatch.setenv("INFERQ_DEPENDENCY_TIMEOUT_S", "0.2")
    get_settings.cache_clear()
    clients.reset()

    async def scenario(client: httpx.AsyncClient) -> list[httpx.Response]:
        client.cookies.set("inferq_console", "some-session", path="/console")
        return [
            await client.get("/console"),
            await client.get("/console/jobs?live=1"),
            await client.post("/console/login", data={"key": acme_key}),
            await client.post("/console/jobs/job_x/cancel", data={"csrf": "x"}),
            await client.get("/console/files/file_x"),
        ]

    for answer in run(scenario):
        assert answer.status_code == 503, (answer.request.url, answer.status_code)
        assert "the queue (Redis) is unavailable" in answer.text
