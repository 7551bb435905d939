"""Where a command finds the stack it talks to: the settings `inferq up` keeps beside its data,
who runs where, and one line for a dependency that could not be reached.

`inferq up` writes the settings its children run with (``SETTINGS_FILE`` in its data
directory: the Redis, database, file store and API they use, and every other ``INFERQ_*``
variable it was given, secrets left out). The commands that read a running stack (``status``,
``submit``, ``get``, ``keys``, ``webhooks``) adopt them when run there, under the environment:
a variable set in the shell still wins, so a second shell in the stack's directory reads what
the stack uses, not the defaults (docs/settings.md, "Where a command reads").
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
from pydantic import SecretStr

from app.core.settings import Settings, get_settings, hide_password

if TYPE_CHECKING:
    # Imported where used: `inferq status` reading the API's snapshot starts without them.
    import redis
    from sqlalchemy.exc import SQLAlchemyError

RECORD_FILE = "up.json"  # in data_dir: the running supervisor's and children's pids
SETTINGS_FILE = "up-settings.json"  # in data_dir: the settings the running stack uses
DEV_KEY_FILE = "dev-api-key"  # in data_dir: the operator's key `inferq up` made (0600)
# This machine's own addresses: where `inferq up` may start a redis-server, and where a
# command may send the operator's key it keeps.
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})

# Secrets are never written to the settings file (it is 0600, but a key or a signing secret is
# not needed to find a stack, and the dev key has a file of its own).
SECRET_VARIABLES = frozenset(
    f"INFERQ_{name.upper()}"
    for name, info in Settings.model_fields.items()
    if info.annotation is not None and SecretStr in getattr(info.annotation, "__args__", ())
)


def keep(settings: Settings, env: dict[str, str]) -> Path:
    """Write the settings a stack's children run with, resolved where they are relative (the
    data directory, the SQLite file, the local file store, the API's URL), for a command run in
    the same place later (:func:`adopt`). ``env`` is the supervisor's environment."""
    kept = {k: v for k, v in env.items() if k.startswith("INFERQ_") and k not in SECRET_VARIABLES}
    data_dir = settings.data_dir.resolve()
    kept |= {
        "INFERQ_DATA_DIR": str(data_dir),
        "INFERQ_DATABASE_URL": settings.sqlalchemy_url,
        "INFERQ_REDIS_URL": settings.redis_url,
        # Host and port, not the URL made of them: a port set in a client's shell still wins.
        "INFERQ_API_HOST": settings.api_host,
        "INFERQ_API_PORT": str(settings.api_port),
        "INFERQ_FILES_URL": settings.files_url,
        "INFERQ_FILES_DIR": str(settings.storage_dir.resolve()),
        "INFERQ_FILES_ENDPOINT": settings.files_endpoint,
        "INFERQ_FILES_REGION": settings.files_region,
    }
    path = data_dir / SETTINGS_FILE
    me = psutil.Process()
    body = {"pid": me.pid, "started": me.create_time(), "settings": dict(sorted(kept.items()))}
    # 0600 from the start: URLs may carry a database's or Redis's password.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(json.dumps(body, indent=1) + "\n")
    return path


@dataclass
class Reading:
    """What a command read its settings from: the settings file it adopted (None: none was
    there) and the variables the environment set over it."""

    path: Path | None = None
    pid: int | None = None
    running: bool = False  # whether that `inferq up` still runs
    overridden: set[str] = field(default_factory=set)

    def summary(self, read: str) -> str:
        """One line: what was read (``snapshot.sources``, or an API and what it read), and
        where the settings that chose it came from."""
        where = get_settings().data_dir
        if self.path is None:
            return f"{read} (the environment's and defaults: no {SETTINGS_FILE} in {where})"
        if self.running:
            kept = f"as the `inferq up` running here (pid {self.pid}) has them: {self.path}"
        else:
            kept = f"as the last `inferq up` here (pid {self.pid}, stopped) had them: {self.path}"
        over = sorted(v for v in self.overridden if v in _WHERE)
        if over:
            kept += f"; {', '.join(over)} from the environment"
        return f"{read} ({kept})"


def api_key(settings: Settings, kept: bool) -> str | None:
    """The key a command sends the API: ``INFERQ_API_KEY``, else (``kept``: the API is on this
    machine's loopback) the operator's key that `inferq up` keeps in its data directory; None:
    neither. The kept key never goes to another host."""
    if settings.api_key is not None:
        return settings.api_key.get_secret_value()
    if not kept:
        return None
    try:
        return (settings.data_dir / DEV_KEY_FILE).read_text().strip() or None
    except OSError:
        return None


_WHERE = {"INFERQ_REDIS_URL", "INFERQ_DATABASE_URL", "INFERQ_FILES_URL"}  # data_dir found it

_reading = Reading()


def adopt() -> Reading:
    """Take the settings of the `inferq up` whose data directory this command's settings name,
    for every variable the environment does not set; returns what was read (also kept for
    :func:`reading`). Nothing happens where no stack wrote its settings."""
    global _reading
    path = get_settings().data_dir / SETTINGS_FILE
    try:
        body = json.loads(path.read_text())
        kept = {str(k): str(v) for k, v in body["settings"].items()}
        pid, started = int(body["pid"]), float(body["started"])
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        _reading = Reading()
        return _reading
    adopted = {k for k in kept if k not in os.environ}
    for variable in adopted:
        os.environ[variable] = kept[variable]
    get_settings.cache_clear()
    try:
        running = abs(psutil.Process(pid).create_time() - started) < 1.0
    except psutil.Error:
        running = False
    _reading = Reading(path.resolve(), pid, running, set(kept) - adopted)
    return _reading


def reading() -> Reading:
    """What :func:`adopt` found in this process (an empty Reading before, or without it)."""
    return _reading


def running_stacks() -> list[tuple[int, Path, dict[str, str]]]:
    """The `inferq up` supervisors this user runs: (pid, data directory, the INFERQ_ settings
    of their environment), for a command run elsewhere to say where to look."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        argv = proc.info["cmdline"] or []
        if "up" not in argv[1:4] or not any(a.endswith(("inferq", "app.cli")) for a in argv[:3]):
            continue
        with contextlib.suppress(psutil.Error):
            env = {k: v for k, v in proc.environ().items() if k.startswith("INFERQ_")}
            data_dir = Path(proc.cwd(), env.get("INFERQ_DATA_DIR", ".inferq")).resolve()
            if (data_dir / RECORD_FILE).exists():
                found.append((proc.pid, data_dir, env))
    return found


def database_setting(settings: Settings) -> str:
    """The setting that chose the database: its URL's, or the data directory's."""
    return "INFERQ_DATABASE_URL" if settings.database_url else "INFERQ_DATA_DIR"


def no_database(command: str) -> str | None:
    """Why there is nothing to read, when the settings name a SQLite file that does not exist
    (opening it would create an empty one: a command that reads must not); else None."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    settings = get_settings()
    try:
        url = make_url(settings.sqlalchemy_url)
    except (ArgumentError, ValueError):
        return None  # the read says what is wrong with it, as for any bad URL
    if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
        return None
    if url.query.get("uri") == "true" or url.database.startswith("file:"):
        return None  # SQLite's URI form: the driver reads the file's path and mode from it
    path = Path(url.database).resolve()
    if path.exists():
        return None
    relative = "" if settings.data_dir.is_absolute() else ", relative to this directory"
    where = (
        "INFERQ_DATABASE_URL"
        if settings.database_url
        else f"INFERQ_DATA_DIR {str(settings.data_dir)!r}{relative}"
    )
    said = f"no inferq database at {path} ({where}). Nothing was created."
    stacks = running_stacks()
    if not stacks:
        return (
            f"{said} Run it where `inferq up` runs, or set INFERQ_DATA_DIR or "
            "INFERQ_DATABASE_URL (and INFERQ_REDIS_URL) to the stack's."
        )
    pid, data_dir, env = stacks[0]
    settings_of = " ".join(
        f"{k}={hide_password(v)}"
        for k, v in sorted({**env, "INFERQ_DATA_DIR": str(data_dir)}.items())
        if k in {"INFERQ_DATA_DIR", "INFERQ_DATABASE_URL", "INFERQ_REDIS_URL"}
    )
    return f"{said} `inferq up` runs with {data_dir} (pid {pid}): {settings_of} inferq {command}"


# --- one line for what could not be reached ------------------------------------------------


def api_setting(settings: Settings) -> str:
    """The settings that chose the API's URL a client command uses."""
    if settings.api_url:
        return "INFERQ_API_URL"
    return "INFERQ_API_HOST and INFERQ_API_PORT, or INFERQ_API_URL"


def no_reading(exc: SQLAlchemyError) -> str:
    """The database could not be read: its URL, the setting that chose it, and the driver's
    own first line (SQLAlchemy's adds the SQL and a link)."""
    settings = get_settings()
    reason = str(getattr(exc, "orig", None) or exc).splitlines()[0]
    url = hide_password(settings.sqlalchemy_url)
    if reason.startswith("no such table"):
        return (
            f"the database at {url} ({database_setting(settings)}) has no inferq tables "
            f"({reason}): run `inferq migrate`, or point the setting at the stack's database"
        )
    return f"cannot read the database at {url} ({database_setting(settings)}): {reason}"


def no_redis(exc: redis.RedisError) -> str:
    """Redis could not be read: its URL (password hidden), the setting, and why."""
    url = hide_password(get_settings().redis_url)
    return f"cannot read Redis at {url} (INFERQ_REDIS_URL): {exc}"


def unreachable(exc: BaseException) -> str | None:
    """One line for a command whose API, database or Redis could not be reached or read: the
    URL it tried and the setting that chose it; None for any other error (the settings are
    read only for these: another error may be a refusal of the settings themselves)."""
    import httpx  # here: a command that calls no API starts without it
    import redis
    from sqlalchemy.exc import SQLAlchemyError

    if isinstance(exc, httpx.TransportError):
        settings = get_settings()
        reason = str(exc) or type(exc).__name__
        if isinstance(exc, httpx.TimeoutException):
            reason = f"no answer in time ({reason})"
        return f"cannot reach the API at {settings.base_url} ({api_setting(settings)}): {reason}"
    if isinstance(exc, SQLAlchemyError):
        return no_reading(exc)
    if isinstance(exc, redis.RedisError):
        return no_redis(exc)
    return None
