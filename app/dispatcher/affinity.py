"""Prefix affinity: which worker's own queue a message goes to, or the shared queue. Pure: the
live workers and their loads go in, a queue comes out (app/dispatcher/refill.py acts on it).

Fair share, deadlines and lanes decide *what* is sent next (app/dispatcher/refill.py); this
decides only *where*. The jobs of one prompt prefix go to one worker, whose engine then holds
that prefix in its cache, as long as that worker is not given more than its share::

    home(p)    = argmax over the model's live workers w of  h(p, w)
                 (rendezvous hashing: h a 64-bit hash of prefix and worker id, so a worker that
                 joins takes only the prefixes whose highest score is now its own, about 1/N,
                 and one that leaves gives away only its own)
    load(w)    = jobs w runs (its claimed jobs of the model) + jobs listed in w's own queue of
                 the lane
    L          = sum of load(w) + jobs listed in the lane's shared queue
    send m (|m| jobs of prefix p) to home(p)'s own queue  iff
                 load(home(p)) + |m|  <=  max(|m|, c * (L + |m|) / N)
    else to the shared queue, which every worker takes from once its own queue is empty
    (then L += |m|, and load(home(p)) += |m| when it went there)

``c`` is ``INFERQ_AFFINITY_LOAD_FACTOR`` (consistent hashing with bounded loads, Mirrokni,
Thorup and Zadimoghaddam, arXiv 1608.01350; HAProxy's ``hash-balance-factor``); the ``max``
lets an idle worker take its own prefix's message whatever its size. A message without a
prefix (nothing in the pick shares it), an embedding model's (its engine keeps no prefix
cache) and a lane that is not affine (realtime) go to the shared queue: routed by load, as
the workers pull. docs/scheduling.md, "Prefix affinity", says why and what it gains.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


def score(prefix: str, worker_id: str) -> int:
    """The rendezvous score of ``worker_id`` for ``prefix``: the highest score is its home."""
    digest = hashlib.blake2b(f"{prefix}\x00{worker_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def home(prefix: str, workers: Iterable[str]) -> str | None:
    """The worker whose cache ``prefix`` belongs to among ``workers`` (None: no worker)."""
    return max(workers, key=lambda w: score(prefix, w), default=None)


@dataclass
class Placement:
    """Where the messages of one refill of one lane go: each is placed in turn, and counted in
    the loads before the next (the formula in the module docstring)."""

    workers: list[str]  # the live workers that consume the lane's own queues
    load: dict[str, int]  # load(w) before this refill
    shared: int  # jobs listed in the lane's shared queue
    factor: float  # c
    sent: dict[str, int] = field(default_factory=dict)  # jobs sent to each own queue
    overflow: dict[str, int] = field(default_factory=dict)  # jobs whose home was past the bound

    @classmethod
    def of(
        cls,
        workers: Iterable[str],
        running: Mapping[str, int],
        listed: Mapping[str, int],
        shared: int,
        factor: float,
    ) -> Placement:
        """``running``: each worker's claimed jobs; ``listed``: the jobs in its own queue."""
        ids = sorted(set(workers))
        load = {w: int(running.get(w, 0)) + int(listed.get(w, 0)) for w in ids}
        return cls(ids, load, shared, factor)

    @property
    def total(self) -> int:
        """L: what the workers run and what is listed for them."""
        return sum(self.load.values()) + self.shared

    def bound(self, size: int) -> float:
        """The most load a worker may have once given a message of ``size`` jobs."""
        return max(size, self.factor * (self.total + size) / len(self.workers))

    def place(self, prefix: str, size: int) -> str | None:
        """The worker whose own queue gets a message of ``size`` jobs of ``prefix``; None: the
        shared queue."""
        if not prefix or len(self.workers) < 2:
            self.shared += size
            return None
        chosen = home(prefix, self.workers)
        assert chosen is not None
        if self.load[chosen] + size <= self.bound(size):
            self.load[chosen] += size
            self.sent[chosen] = self.sent.get(chosen, 0) + size
            return chosen
        self.shared += size
        self.overflow[chosen] = self.overflow.get(chosen, 0) + size
        return None
