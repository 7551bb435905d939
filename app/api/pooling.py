"""An embeddings, rerank or score call served as a job: submit it, wait for its end, answer
with the committed vectors or scores (docs/openai.md, "Embeddings, rerank and score").

The call is a pooled job like any other (realtime lane unless the body says ``lane`` or
``service_tier``), submitted and followed the way a chat call is (app/api/completions.py,
``start``): a caller that leaves cancels its job, and a model with no live worker answers 503
after ``INFERQ_MODEL_WAIT_S``. The vectors come in the relay's end message, base64, or, past
its bound (``relay.END_BYTES_MAX``), from the job's row.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from app.api import completions
from app.core.db import session_scope
from app.core.messaging import relay
from app.core.models import Job, JobStatus
from app.core.openai.openai_format import Ended, JobView, job_error
from app.core.openai.pooling_format import (
    EmbeddingRequest,
    Pooled,
    PooledRequest,
    RerankRequest,
    dumps,
    embedding_response,
    pooled_of,
    rerank_response,
    score_response,
)


def _of(view: Job | Ended) -> Pooled:
    assert view.pooled is not None and view.pooled_width is not None
    return pooled_of(
        view.id, view.created_at, view.model, view.pooled, view.pooled_width, view.prompt_tokens
    )


def _from_row(job_id: str) -> Pooled:
    with session_scope() as session:
        job = session.get(Job, job_id)
        assert job is not None
        return _of(job)


async def _pooled(ended: JobView) -> Pooled:
    """The call's rows: from the end message, from the row it was read from, or (left out of
    the message as too large) read now."""
    if isinstance(ended, Ended) and (ended.pooled is None or ended.pooled_width is None):
        return await run_in_threadpool(_from_row, ended.id)
    assert isinstance(ended, Job | Ended)
    return _of(ended)


async def answer(body: PooledRequest, request: Request, tenant: str) -> Response:
    call, ended = await completions.start(body, request, tenant)
    if ended is None:
        return Response(status_code=499)
    await call.close()
    assert not isinstance(ended, relay.Entry)  # a pooled job streams nothing: only its end
    if ended.status != JobStatus.SUCCEEDED:
        raise job_error(ended)
    pooled = await _pooled(ended)
    if isinstance(body, EmbeddingRequest):
        data = embedding_response(pooled, body.encoding_format)
    elif isinstance(body, RerankRequest):
        documents = [body.documents] if isinstance(body.documents, str) else body.documents
        data = rerank_response(pooled, documents, body.top_n, body.return_documents)
    else:
        data = score_response(pooled)
    # A 2,048-input answer of 1,024-d vectors is two million floats (docs/openai.md).
    return Response(
        dumps(data),
        media_type="application/json",
        headers={completions.JOB_HEADER: call.job.id},
    )
