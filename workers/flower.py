"""Entry point of Flower, the Celery dashboard (`inferq flower` runs `python -m workers.flower`).

This module owns how Flower is run against inferq: in-process on a Celery app made like the
workers' (``workers.celery_app.create``: the broker, the transport and the queue declarations
are ours, from settings), the bind address and port, basic auth, and what the dashboard shows:

- Flower can revoke tasks and shut workers down, so it refuses to listen beyond loopback
  without basic auth (``INFERQ_FLOWER_BASIC_AUTH``, ``user:password``).
- The Broker tab lists every inferq queue (lanes, ``webhooks``, ``maintenance``) with its
  length, including a lane no worker consumes at the moment.
- The Tasks tab shows each task's lane as its routing key: every ``run_jobs`` message is
  published to its lane's queue with the lane as routing key, and its sender adds a
  ``task-sent`` event that carries it while Flower says it watches
  (``app/core/messaging/broker.py``, ``mark_watched``: a key in Redis that Flower sets again and
  again while it runs).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from app.core.messaging import broker
from app.core.messaging.names import OPS_QUEUES, TASKS
from app.core.scheduling import catalog
from app.core.settings import Settings, get_settings

# The task list's columns: the queue (routing_key: lane and model) and the job ids (args) next to
# Flower's own.
TASKS_COLUMNS = "name,uuid,state,routing_key,args,received,started,runtime,worker"

log = logging.getLogger("inferq.flower")


def is_loopback(address: str) -> bool:
    """Whether ``address`` binds loopback only; "" (Flower: every interface) and names do not."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False  # a host name may resolve anywhere: treated as reachable from outside


def bind_problem(settings: Settings) -> str | None:
    """Why Flower must not start with these settings, or None."""
    auth = settings.flower_basic_auth
    if auth is None:
        if is_loopback(settings.flower_address):
            return None
        return (
            f"refusing to bind Flower to {settings.flower_address or 'every interface'!r} "
            "without basic auth: Flower can revoke tasks and shut workers down. Set "
            "INFERQ_FLOWER_BASIC_AUTH=user:password, or bind a loopback address "
            "(INFERQ_FLOWER_ADDRESS=127.0.0.1)."
        )
    user, sep, password = auth.get_secret_value().partition(":")
    if not (user and sep and password):
        return "INFERQ_FLOWER_BASIC_AUTH must be user:password, both non-empty"
    if "," in auth.get_secret_value():
        # Flower splits --basic-auth on commas into several credentials: a password with a
        # comma would turn its tail into a credential of its own.
        return "INFERQ_FLOWER_BASIC_AUTH must not contain ',' (Flower splits on it)"
    return None


def flower_argv(settings: Settings) -> list[str]:
    """The `celery flower` command line run in-process on our Celery app."""
    argv = [
        "flower",
        f"--address={settings.flower_address}",
        f"--port={settings.flower_port}",
        f"--tasks_columns={TASKS_COLUMNS}",
    ]
    if settings.flower_basic_auth is not None:
        # In-process: the password is in this list, never in the process's command line.
        argv.append(f"--basic_auth={settings.flower_basic_auth.get_secret_value()}")
    return argv


def list_every_queue() -> None:
    """Make Flower's Broker tab (and /api/queues/length) list all of inferq's queues: every
    known model's lanes (app/core/scheduling/catalog.py) and the ops worker's queues.

    Flower lists the queues the live workers consume and falls back to the configured ones
    only when no worker answers. Inference workers close lanes at run time, a model may have
    no worker (scaled to zero) and the ops worker may be down, and a queue with a backlog and
    no consumer is the one to see.
    """
    from flower.views import BaseHandler

    own: Callable[[Any], list[str]] | None = getattr(BaseHandler, "get_active_queue_names", None)
    if own is None:  # another Flower version: its own list, not worth failing over
        log.warning("Flower's queue list was not extended; the Broker tab shows its own")
        return

    def queue_names(handler: Any) -> list[str]:
        # Ours in priority order, then any other queue a worker consumes.
        ours = [*catalog.queues(), *OPS_QUEUES]
        return [*ours, *sorted(set(own(handler)) - set(ours))]

    BaseHandler.get_active_queue_names = queue_names


def _run_by_the_workers(*_: Any, **__: Any) -> None:
    raise RuntimeError("inferq's tasks run in its workers, not in Flower")


def keep_watching() -> None:
    """Say in Redis that Flower watches, as long as it runs (senders then add task-sent events
    to their messages; workers are told to send task events by Flower itself)."""
    while True:
        try:
            broker.mark_watched()
        except redis.RedisError as exc:
            log.warning("could not say that Flower watches: %s", exc)
        time.sleep(broker.WATCH_TTL_S / 3)


def main() -> None:
    settings = get_settings()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    problem = bind_problem(settings)
    if problem:
        sys.stderr.write(f"inferq flower: {problem}\n")
        sys.exit(2)

    from celery.bin.celery import celery
    from flower.command import flower

    from workers import celery_app as apps

    celery_app = apps.create("flower", settings)
    # Flower's task views (task types, apply) look tasks up by name on its own app: every
    # inferq task is known there by name, run by the workers only.
    for name in TASKS:
        celery_app.task(name=name)(_run_by_the_workers)

    # Registered here, as flower's own `python -m flower` does, rather than relying on the
    # `celery.commands` entry point being present in the environment's metadata.
    celery.add_command(flower)
    list_every_queue()
    # Workers send task events only while someone watches (workers/celery_app.py): turn them
    # on now, not at Flower's first periodic enable five seconds from here.
    with contextlib.suppress(Exception):  # the broker is down: Flower's timer retries
        celery_app.control.enable_events()
    threading.Thread(target=keep_watching, name="flower-watching", daemon=True).start()
    sys.exit(celery_app.start(flower_argv(settings)) or 0)


if __name__ == "__main__":
    main()
