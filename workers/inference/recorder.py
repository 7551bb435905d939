"""The result recorder: group commit of job outcomes behind the fence, from one thread.

Outcomes from every task thread of a worker queue up here; one thread writes whatever has
queued up in one transaction (``transitions.record``: an executemany fenced by each row's lease
token), then does what follows the commit: the log lines and counters, the webhook events (to
the worker's announcer thread), the latency histograms, and the relay's end marker for a caller
waiting on the job. Per-row transactions made the recorder the bottleneck of a busy worker
(docs/architecture.md, "Group commit").

The relay publisher and the webhook announcer it uses are the worker's (built by
workers/inference/main.py and passed in); :meth:`Recorder.start` starts their threads with its
own. The executor announces the events of its claims through the same announcer.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from functools import partial

from app.core.db import with_db_retry
from app.core.lifecycle import transitions
from app.core.lifecycle.changes import changes
from app.core.lifecycle.transitions import Outcome
from app.core.messaging import relay
from app.core.models import JobStatus, now
from app.core.webhooks import outbox
from workers import metrics
from workers.inference.claims import Claim

log = logging.getLogger("inferq.recorder")

RECORD_BATCH = 512  # most outcomes in one transaction

Item = tuple[Claim, Outcome, concurrent.futures.Future[bool]]


class Recorder:
    def __init__(
        self, worker_id: str, publisher: relay.Publisher, announcer: outbox.Announcer
    ) -> None:
        self.worker_id = worker_id
        self.relay = publisher
        self.announce = announcer.put
        self._announcer = announcer
        self._queue: queue.SimpleQueue[Item] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="recorder", daemon=True)

    def start(self) -> None:
        """Start this thread, the relay's and the announcer's."""
        self.relay.start()
        self._announcer.start()
        self._thread.start()

    def put(self, claim: Claim, outcome: Outcome) -> concurrent.futures.Future[bool]:
        """Queue an outcome; the future says whether it was written (False: fenced off)."""
        future: concurrent.futures.Future[bool] = concurrent.futures.Future()
        if claim.reply_to is not None:
            future.add_done_callback(partial(self._relay_end, claim, outcome))
        self._queue.put((claim, outcome, future))
        return future

    def stored(
        self, claim: Claim, outcome: Outcome, written: concurrent.futures.Future[bool]
    ) -> str | None:
        """The status the job was left in (None: fenced off, nothing written).

        An outcome the database refuses fails the job instead of leaving it running.
        """
        try:
            return str(outcome.status) if written.result() else None
        except Exception as exc:
            log.exception("job %s: its outcome could not be stored; failing it", claim.job_id)
            failed = Outcome(
                JobStatus.FAILED,
                error_code="result_not_stored",
                error_message=f"the result could not be stored ({type(exc).__name__})",
            )
            return str(failed.status) if self.put(claim, failed).result() else None

    def write(self, items: list[tuple[Claim, Outcome]]) -> list[bool]:
        """Write outcomes in one transaction, then what follows it; returns which were written."""
        stamp = now()
        with changes("worker", worker=self.worker_id, announce=self.announce) as tx:
            written = transitions.record(
                tx, [(claim.lease, outcome) for claim, outcome in items], stamp=stamp
            )
        for (claim, outcome), ok in zip(items, written, strict=True):
            if ok:
                self._observe(claim, outcome, stamp)
        return written

    def _observe(self, claim: Claim, outcome: Outcome, stamp: float) -> None:
        lane = claim.lease.lane
        if outcome.first_token_at is not None:
            metrics.TTFT.labels(lane).observe(max(0.0, outcome.first_token_at - claim.created_at))
        if outcome.status == JobStatus.SUCCEEDED:
            metrics.E2E.labels(lane).observe(max(0.0, stamp - claim.created_at))

    def _relay_end(
        self, claim: Claim, outcome: Outcome, written: concurrent.futures.Future[bool]
    ) -> None:
        """The outcome is committed (not fenced off): the waiting caller gets it as stored."""
        ok = not written.cancelled() and written.exception() is None and written.result()
        if ok and claim.reply_to is not None:
            self.relay.end(claim.reply_to, claim.token, outcome.row())

    def _loop(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < RECORD_BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                self._settle(batch)
            except Exception:
                # One bad row must not take the others down with it: write them one by one.
                log.exception("recording %d outcomes together failed; one by one now", len(batch))
                for item in batch:
                    try:
                        self._settle([item])
                    except Exception as exc:
                        item[2].set_exception(exc)

    def _settle(self, batch: list[Item]) -> None:
        items = [(claim, outcome) for claim, outcome, _ in batch]
        written = with_db_retry(partial(self.write, items), "record")
        for (_, _, future), ok in zip(batch, written, strict=True):
            future.set_result(ok)
