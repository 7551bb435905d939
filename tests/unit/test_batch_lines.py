"""A batch file's lines read and judged, and output lines written, without a stack (no database,
no Redis): app/batches/validation.py's ``lines`` and ``parse``, app/batches/finalize.py's
``output_line``."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest

from app.batches.finalize import output_line
from app.batches.validation import lines, parse
from app.core.errors import DomainError, Kind
from app.core.models import BatchStatus, Job, JobStatus
from app.core.settings import DEMO_MODEL_NAME

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def line(body: dict[str, Any], **fields: Any) -> bytes:
    record = {"custom_id": "a", "method": "POST", "url": CHAT, "body": body, **fields}
    return json.dumps(record).encode() + b"\n"


def chat(**body: Any) -> dict[str, Any]:
    return {"model": DEMO_MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], **body}


def refusal(raw: bytes | None, endpoint: str = CHAT, limit: int = 10_000) -> DomainError:
    with pytest.raises(DomainError) as refused:
        parse(raw, endpoint, limit)
    assert refused.value.kind == Kind.INVALID
    return refused.value


def test_lines_are_numbered_blank_ones_skipped_and_long_ones_marked() -> None:
    source = io.BytesIO(b'{"a": 1}\n\n   \n' + b"x" * 50 + b"\n{}\n" + b"y" * 30)
    assert list(lines(source, 20)) == [(1, b'{"a": 1}\n'), (4, None), (5, b"{}\n"), (6, None)]


def test_a_good_line_becomes_its_job_body() -> None:
    raw = line(chat(max_tokens=7, temperature=0.5), custom_id="q-1")
    parsed = parse(raw, CHAT, 10_000)
    custom_id, job, model = parsed.custom_id, parsed.job, parsed.model
    assert custom_id == "q-1" and model == DEMO_MODEL_NAME and job is not None
    assert job.messages is not None and job.messages[0].content == "hi"
    assert job.params.max_tokens == 7 and job.params.temperature == 0.5
    assert job.lane.value == "realtime"  # the endpoint's default; a batch moves it to bulk


@pytest.mark.parametrize(
    ("raw", "code", "param"),
    [
        (None, "line_too_long", None),
        (b"{not json\n", "invalid_json", None),
        (b"[1, 2]\n", "invalid_line", None),
        (line(chat(), extra=1), "invalid_line", "extra"),
        (line(chat(), custom_id=""), "invalid_custom_id", "custom_id"),
        (line(chat(), custom_id=7), "invalid_custom_id", "custom_id"),
        (line(chat(), method="GET"), "invalid_method", "method"),
        (line(chat(), url=COMPLETIONS), "mismatched_url", "url"),
        (line("text"), "invalid_body", "body"),  # type: ignore[arg-type]
        (line(chat(stream=True)), "invalid_body", "body.stream"),
        (line(chat(model="another")), "model_not_found", "body.model"),
        (line(chat(temperature=9)), "less_than_equal", "body.temperature"),
        (line(chat(max_tokenz=3)), "extra_forbidden", "body.max_tokenz"),
        (line(chat(top_k=-2)), "greater_than_equal", "body.top_k"),
        (line(chat(max_tokens=4, min_tokens=5)), "min_tokens_above_max", "body.min_tokens"),
        (line(chat(tools=[{"type": "function"}])), "missing", "body.tools[0].function"),
        (line(chat(tool_choice="required")), "missing", "body.tool_choice"),
        (line({"model": DEMO_MODEL_NAME}), "missing", "body.messages"),
    ],
)
def test_a_bad_line_is_refused_naming_what_is_wrong(
    raw: bytes | None, code: str, param: str | None
) -> None:
    error = refusal(raw)
    assert (error.code, error.param) == (code, param)
    assert error.message


def job(status: JobStatus, **values: Any) -> Job:
    return Job(
        id="job_01abc",
        custom_id="line-1",
        status=status,
        messages=[{"role": "user", "content": "hi"}],
        model=DEMO_MODEL_NAME,
        created_at=1.0,
        **values,
    )


def test_output_lines_follow_openais_format() -> None:
    done = json.loads(
        output_line(
            job(
                JobStatus.SUCCEEDED,
                result_text="hello",
                finish_reason="stop",
                prompt_tokens=3,
                completion_tokens=1,
            ),
            BatchStatus.COMPLETED,
        )
    )
    assert done["id"] == "batch_req_01abc" and done["custom_id"] == "line-1"
    assert done["error"] is None and done["response"]["status_code"] == 200
    assert done["response"]["body"]["choices"][0]["message"]["content"] == "hello"
    assert done["response"]["body"]["usage"]["total_tokens"] == 4


@pytest.mark.parametrize(
    ("status", "code", "http"),
    [
        (JobStatus.FAILED, "context_length_exceeded", 400),  # the request's fault
        (JobStatus.FAILED, "engine_error", 500),
        (JobStatus.EXPIRED, "deadline_exceeded", 504),
    ],
)
def test_a_failed_line_carries_the_answer_its_request_would_have_had(
    status: JobStatus, code: str, http: int
) -> None:
    failed = json.loads(
        output_line(job(status, error_code=code, error_message="why"), BatchStatus.COMPLETED)
    )
    assert failed["error"] is None
    assert failed["response"]["status_code"] == http
    assert failed["response"]["body"]["error"]["code"] == code


def test_lines_the_batch_stopped_say_how_it_ended() -> None:
    for final, code in (
        (BatchStatus.CANCELLED, "batch_cancelled"),
        (BatchStatus.EXPIRED, "batch_expired"),
    ):
        stopped = json.loads(output_line(job(JobStatus.CANCELLED), final))
        assert stopped["response"] is None and stopped["error"]["code"] == code
