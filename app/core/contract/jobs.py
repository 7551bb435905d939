"""The jobs API's contract (docs/api.md, "HTTP API (v1)"): a job's body (``POST /v1/jobs``,
and what every other surface turns its request into) and the Job object a caller gets back,
which a job's webhook event carries too.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Field,
    StrictInt,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from app.core.contract.base import check_metadata, check_webhook_scheme, secs
from app.core.contract.chat import ChatMessage, ToolUse
from app.core.contract.params import JobParams
from app.core.contract.pooling import (
    EmbedInput,
    Inputs,
    PoolingOptions,
    check_items,
    embed_items,
    score_pairs,
    unpack,
)
from app.core.models import Job, JobKind, JobStatus, Lane, NewJob
from app.core.settings import get_settings

# A completion's prompt, in every form vLLM's server takes: a text, token ids, several texts or
# several lists of token ids (several prompts: one choice per prompt and per ``n``).
TokenIds = list[StrictInt]
Prompt = str | TokenIds  # one prompt


def _one_of_the_forms(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """One error that names the forms, not one per member of the union."""
    try:
        return handler(value)
    except ValidationError:
        raise PydanticCustomError(
            "prompt_form",
            "prompt is a string, a list of token ids, a list of strings or a list of lists of "
            "token ids",
        ) from None


PromptForm = Annotated[
    str | TokenIds | list[str] | list[TokenIds], WrapValidator(_one_of_the_forms)
]


def prompt_bounds(value: PromptForm) -> PromptForm:
    """Several prompts as one when they are one (``["x"]`` is ``"x"``, as in vLLM), each
    within the bounds of a pooled job's items (INFERQ_POOL_MAX_INPUTS prompts, none empty,
    each at most INFERQ_MAX_PROMPT_CHARS characters or its token ids not negative)."""
    if isinstance(value, str):
        if not value:
            raise ValueError("prompt must not be empty")
        limit = get_settings().max_prompt_chars
        if len(value) > limit:
            raise ValueError(f"prompt is longer than {limit} characters")
        return value
    items: list[Any] = value if value and not isinstance(value[0], int) else [value]
    check_items(items, "prompt")
    return items[0] if len(items) == 1 else items


class JobCreate(ToolUse):
    lane: Lane = Lane.STANDARD
    model: str | None = Field(None, min_length=1, max_length=256)
    prompt: PromptForm | None = Field(
        None,
        description="A text, token ids, several texts or several lists of token ids (one "
        "choice per prompt and per n).",
    )
    messages: list[ChatMessage] | None = Field(None, validate_default=True)
    params: JobParams = Field(default_factory=lambda: JobParams())
    webhook_url: str | None = Field(None, max_length=2048)
    metadata: dict[str, str] = Field(default_factory=dict)
    timeout_s: float | None = Field(None, gt=0)
    user: str | None = Field(
        None, max_length=256, description="Your id for your end user (OpenAI's), recorded."
    )
    # A pooled job (docs/openai.md, "Embeddings, rerank and score"): what to embed, or a
    # query and the documents to score against it, on a model of that task.
    input: EmbedInput | None = Field(
        None, description="Embed: a string, strings, token ids, or lists of token ids."
    )
    query: str | list[str] | None = Field(
        None, description="Score: the query, or one query per document."
    )
    documents: list[str] | None = Field(None, description="Score: the texts to score.")
    pooling: PoolingOptions | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_bounds(cls, value: PromptForm | None) -> PromptForm | None:
        return None if value is None else prompt_bounds(value)

    @field_validator("messages")
    @classmethod
    def _messages_bounds(cls, value: list[ChatMessage] | None) -> list[ChatMessage] | None:
        if value is not None:
            limit = get_settings().max_messages
            if not value:
                raise ValueError("messages must not be empty")
            if len(value) > limit:
                raise ValueError(f"at most {limit} messages are allowed")
        return value

    @field_validator("input")
    @classmethod
    def _input_bounds(cls, value: EmbedInput | None) -> EmbedInput | None:
        if value is not None:
            check_items(embed_items(value), "input")
        return value

    @field_validator("documents")
    @classmethod
    def _documents_bounds(cls, value: list[str] | None) -> list[str] | None:
        if value is not None:
            check_items(value, "documents")
        return value

    @model_validator(mode="after")
    def _exactly_one_input(self) -> JobCreate:
        given = [
            name
            for name, value in (
                ("prompt", self.prompt),
                ("messages", self.messages),
                ("input", self.input),
                ("query", self.query if self.query is not None else self.documents),
            )
            if value is not None
        ]
        if len(given) != 1 and set(given) <= {"prompt", "messages"}:
            # Either field may be the one the caller meant: the error names both
            # (``fields`` becomes its ``param``: app/api/handlers.py).
            raise PydanticCustomError(
                "prompt_or_messages",
                "exactly one of `prompt` or `messages` is required (or, for a pooled job, "
                "`input` to embed, or `query` and `documents` to score)",
                {"fields": "prompt|messages"},
            )
        if len(given) != 1:
            raise PydanticCustomError(
                "one_input",
                f"a job has one kind of input: {', '.join(given)} were given together",
                {"fields": given[-1]},
            )
        if given == ["query"]:
            if self.query is None or self.documents is None:
                missing = "query" if self.query is None else "documents"
                raise PydanticCustomError(
                    "missing", "a scoring job needs `query` and `documents`", {"fields": missing}
                )
            try:
                score_pairs(self.query, self.documents)
            except ValueError as exc:
                raise PydanticCustomError("query", str(exc), {"fields": "query"}) from None
        return self

    @model_validator(mode="after")
    def _pooled_options(self) -> JobCreate:
        pooled = self.kind != JobKind.GENERATE
        if pooled and self.params.stored():
            raise PydanticCustomError(
                "unsupported_parameter",
                "params are sampling options, which a pooled job has none of: `pooling` "
                "holds its options",
                {"fields": "params"},
            )
        if self.pooling is not None and not pooled:
            raise PydanticCustomError(
                "unsupported_parameter",
                "pooling options are for jobs that embed (`input`) or score (`query`)",
                {"fields": "pooling"},
            )
        return self

    @property
    def kind(self) -> JobKind:
        """What the job asks of its model, from the input it gives."""
        if self.input is not None:
            return JobKind.EMBED
        if self.query is not None or self.documents is not None:
            return JobKind.SCORE
        return JobKind.GENERATE

    def prompts(self) -> list[Prompt]:
        """A completion's prompts, each a text or token ids ([] for a chat or pooled job)."""
        if self.prompt is None:
            return []
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]  # type: ignore[list-item]
        return list(self.prompt)  # type: ignore[arg-type]

    def prompt_row(self) -> tuple[str | None, list[Prompt] | None]:
        """What a generation job's row keeps of its prompt: one text in ``prompt`` (the common
        form, as it always was), any other form in ``inputs`` as the list of its prompts."""
        if self.prompt is None or isinstance(self.prompt, str):
            return self.prompt, None
        return None, self.prompts()

    def most_output_tokens(self) -> int:
        """What the job can generate: every choice of every prompt can run to max_tokens."""
        return max(1, len(self.prompts())) * self.params.most_output_tokens()

    def pooled_inputs(self) -> Inputs | None:
        """A pooled job's ``Job.inputs``; None for a generation job."""
        if self.input is not None:
            return embed_items(self.input)
        if self.query is not None and self.documents is not None:
            return score_pairs(self.query, self.documents)
        return None

    def pooling_options(self) -> dict[str, Any]:
        return {} if self.pooling is None else self.pooling.stored()

    @model_validator(mode="after")
    def _tools_in_a_chat(self) -> JobCreate:
        if self.tools and self.messages is None:
            raise PydanticCustomError(
                "tools_need_messages", "tools are for chat jobs (messages)", {"fields": "tools"}
            )
        if self.params.structured_outputs is not None and self.tool_constraint() is not None:
            raise PydanticCustomError(
                "unsupported_parameter",
                "tool_choice required or named holds the output to the tools' schemas: it "
                "cannot be combined with structured_outputs or response_format",
                {"fields": "tool_choice"},
            )
        return self

    @field_validator("webhook_url")
    @classmethod
    def _webhook_scheme(cls, value: str | None) -> str | None:
        return check_webhook_scheme(value)

    @field_validator("metadata")
    @classmethod
    def _metadata_bounds(cls, value: dict[str, str]) -> dict[str, str]:
        return check_metadata(value)

    @field_validator("timeout_s")
    @classmethod
    def _timeout_bound(cls, value: float | None) -> float | None:
        limit = get_settings().max_timeout_s
        if value is not None and value > limit:
            raise ValueError(f"timeout_s must be at most {limit}")
        return value


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float


class TokenLogprob(BaseModel):
    token: str
    logprob: float | None = Field(
        description="null for an echoed prompt's first token: nothing precedes it."
    )
    top_logprobs: list[TopLogprob]


class PromptTopLogprob(BaseModel):
    token_id: int
    token: str
    logprob: float
    rank: int | None


class PromptTokenLogprob(BaseModel):
    token_id: int
    token: str
    logprob: float | None = Field(description="null for the first token.")
    rank: int | None
    top_logprobs: list[PromptTopLogprob]


class MadeFunction(BaseModel):
    # What the model wrote, as it wrote it: a parsed name need not follow the request's rule.
    name: str
    arguments: str


class MadeCall(BaseModel):
    id: str
    type: Literal["function"]
    function: MadeFunction


class JobChoice(BaseModel):
    index: int
    text: str = Field(description="The whole output, tool calls included.")
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None
    tool_calls: list[MadeCall] | None = Field(
        None, description="The calls found in the text, where the job had tools."
    )
    content: str | None = Field(None, description="With tool_calls: the text around them.")
    stop_reason: str | int | None = Field(
        None, description="The stop string (or stop token id) that ended it, if one did."
    )
    prompt_logprobs: list[PromptTokenLogprob] | None = Field(
        None,
        description="Its prompt's tokens' logprobs, where the job asked for prompt_logprobs "
        "(or for echo with logprobs).",
    )


class JobResult(BaseModel):
    text: str | None = Field(description="Choice 0's text (None for a pooled job).")
    finish_reason: str | None
    usage: Usage = Field(description="completion_tokens counts every choice's tokens.")
    choices: list[JobChoice] | None = Field(
        None, description="Every choice, where the job asked for n > 1 or for logprobs."
    )
    embeddings: list[list[float]] | None = Field(
        None,
        description="An embedding job's vectors, in input order (left out of webhook events: "
        "GET the job).",
    )
    scores: list[float] | None = Field(
        None, description="A scoring job's scores, in document order."
    )


class JobError(BaseModel):
    code: str
    message: str


def _ms(start: float | None, end: float | None) -> int | None:
    return None if start is None or end is None else max(0, round((end - start) * 1000))


class JobTimings(BaseModel):
    """When the job passed each point, in unix seconds with milliseconds, and the spans between.

    ``started_at`` and ``first_token_at`` belong to the job's last attempt.
    """

    queued_at: float
    started_at: float | None
    first_token_at: float | None
    finished_at: float | None
    queue_ms: int | None = Field(description="queued_at to started_at: time spent waiting.")
    ttft_ms: int | None = Field(description="queued_at to first_token_at: time to first token.")
    duration_ms: int | None = Field(description="started_at to finished_at: time running.")

    @classmethod
    def from_row(cls, job: Job | NewJob) -> JobTimings:
        def ms3(value: float | None) -> float | None:
            return None if value is None else round(value, 3)

        started = job.started_at if job.status != JobStatus.QUEUED else None
        return cls(
            queued_at=round(job.created_at, 3),
            started_at=ms3(started),
            first_token_at=ms3(job.first_token_at),
            finished_at=ms3(job.finished_at),
            queue_ms=_ms(job.created_at, started),
            ttft_ms=_ms(job.created_at, job.first_token_at),
            duration_ms=_ms(started, job.finished_at),
        )


class JobOut(BaseModel):
    id: str
    object: Literal["job"] = "job"
    kind: str = Field(description="generate, embed or score.")
    status: str
    lane: str
    model: str
    created_at: int
    started_at: int | None
    finished_at: int | None
    result: JobResult | None
    error: JobError | None
    attempts: int
    metadata: dict[str, str]
    user: str | None
    webhook_url: str | None
    batch_id: str | None
    timings: JobTimings

    @classmethod
    def from_row(cls, job: Job | NewJob, *, vectors: bool = True) -> JobOut:
        """The Job object of a row; ``vectors=False`` leaves an embedding job's vectors out
        (a webhook event's data: a 2,048-input job's would be megabytes)."""
        result = None
        if job.pooled is not None:
            result = _pooled_result(job, vectors)
        elif job.result_text is not None:
            prompt_tokens = job.prompt_tokens or 0
            completion_tokens = job.completion_tokens or 0
            result = JobResult(
                text=job.result_text,
                finish_reason=job.finish_reason,
                usage=Usage(
                    prompt_tokens=prompt_tokens,
                    completion_tokens=completion_tokens,
                    total_tokens=prompt_tokens + completion_tokens,
                ),
                choices=None
                if job.choices is None
                else [JobChoice.model_validate(c) for c in job.choices],
            )
        error = None
        if job.error_code is not None:
            error = JobError(code=job.error_code, message=job.error_message or "")
        return cls(
            id=job.id,
            kind=job.kind,
            status=job.status,
            lane=job.lane,
            model=job.model,
            created_at=int(job.created_at),
            started_at=secs(job.started_at),
            finished_at=secs(job.finished_at),
            result=result,
            error=error,
            attempts=job.attempts,
            metadata=dict(job.meta or {}),
            user=job.end_user,
            webhook_url=job.webhook_url,
            batch_id=job.batch_id,
            timings=JobTimings.from_row(job),
        )


def _pooled_result(job: Job | NewJob, vectors: bool) -> JobResult:
    assert job.pooled is not None and job.pooled_width is not None
    rows = unpack(job.pooled, job.pooled_width)
    prompt_tokens = job.prompt_tokens or 0
    usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=0, total_tokens=prompt_tokens)
    if job.kind == JobKind.SCORE:
        return JobResult(text=None, finish_reason=None, usage=usage, scores=[r[0] for r in rows])
    return JobResult(
        text=None, finish_reason=None, usage=usage, embeddings=rows if vectors else None
    )
