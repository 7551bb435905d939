"""any text: NUL stored byte for byte on PostgreSQL (docs/architecture.md, "Any valid text is
stored")

PostgreSQL's text and jsonb refuse NUL, so from this revision the columns that hold a caller's
text are escaped there (app/core/models.py, ESCAPE): NUL is written U+FFFF "0" and U+FFFF itself
U+FFFF U+FFFF. A row written before held any U+FFFF as it is, so each U+FFFF in those columns is
doubled here, and such a row reads back unchanged. One UPDATE a table, over the rows with a
U+FFFF only (a scan of the table). The columns of a caller's text that were VARCHAR(n) become
TEXT, since escaping may lengthen a value past n (the API bounds their length in characters).

SQLite stores NUL as it is: nothing changes there.

Downgrade (PostgreSQL): refused while any row holds a NUL, which revision 0012 cannot store;
otherwise every U+FFFF U+FFFF is one U+FFFF again and the columns VARCHAR(n) again (PostgreSQL
refuses that for a value now longer than n).

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-02 09:00:00
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The columns app/core/models.py types AnyText or AnyString, and the JSON ones (JSONType).
TEXT = {
    "jobs": ["prompt", "webhook_url", "custom_id", "end_user", "result_text", "error_message"],
    "responses": ["request", "input", "context"],
    "webhook_endpoints": ["name", "url"],
    "webhook_events": ["url", "body"],
    "webhook_attempts": ["url", "error", "response_body"],
    "files": ["filename"],
    "batches": ["webhook_url"],
}
JSON = {
    "jobs": [
        "messages",
        "params",
        "tools",
        "metadata",
        "inputs",
        "lines",
        "line_results",
        "choices",
    ],
    "batches": ["errors", "metadata"],
}
# AnyString(n): VARCHAR(n) before this revision, TEXT after it (PostgreSQL).
WIDENED = {
    ("jobs", "custom_id"): 512,
    ("jobs", "end_user"): 256,
    ("webhook_endpoints", "name"): 255,
    ("files", "filename"): 255,
}

ESC = "chr(65535)"


def _columns(table: str) -> list[tuple[str, bool]]:
    """(quoted column, is JSON) of each escaped column of ``table``."""
    return [(f'"{c}"', False) for c in TEXT.get(table, [])] + [
        (f'"{c}"', True) for c in JSON.get(table, [])
    ]


def _as_text(column: str, is_json: bool) -> str:
    return f"{column}::text" if is_json else column


def _rewrite(table: str, old: str, new: str) -> None:
    """Replace ``old`` by ``new`` (SQL expressions) in each escaped column of ``table``, in
    the rows where any of them holds a U+FFFF."""
    columns = _columns(table)
    sets = []
    for column, is_json in columns:
        value = _as_text(column, is_json)
        replaced = f"replace({value}, {old}, {new})"
        if is_json:
            replaced = f"({replaced})::jsonb"
        sets.append(
            f"{column} = CASE WHEN strpos({value}, {ESC}) > 0 THEN {replaced} ELSE {column} END"
        )
    where = " OR ".join(f"strpos({_as_text(c, j)}, {ESC}) > 0" for c, j in columns)
    # Names and expressions are this module's constants.
    op.execute(f'UPDATE "{table}" SET {", ".join(sets)} WHERE {where}')  # noqa: S608


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for (table, column), _length in WIDENED.items():
        op.execute(f'ALTER TABLE "{table}" ALTER COLUMN "{column}" TYPE TEXT')
    for table in sorted(set(TEXT) | set(JSON)):
        _rewrite(table, ESC, f"{ESC} || {ESC}")


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    # An escaped NUL: U+FFFF "0" after an even number of U+FFFF (none, or escaped U+FFFFs).
    nul = f"'(^|[^' || {ESC} || '])(' || {ESC} || {ESC} || ')*' || {ESC} || '0'"
    for table in sorted(set(TEXT) | set(JSON)):
        held = " OR ".join(f"{_as_text(c, j)} ~ ({nul})" for c, j in _columns(table))
        query = f'SELECT count(*) FROM "{table}" WHERE {held}'  # noqa: S608 (constants)
        count = bind.exec_driver_sql(query).scalar()
        if count:
            raise RuntimeError(
                f"{count} rows of {table} hold NUL, which revision 0012 cannot store on "
                "PostgreSQL: delete them or change their text before downgrading"
            )
    for table in sorted(set(TEXT) | set(JSON)):
        _rewrite(table, f"{ESC} || {ESC}", ESC)
    for (table, column), length in WIDENED.items():
        op.execute(f'ALTER TABLE "{table}" ALTER COLUMN "{column}" TYPE VARCHAR({length})')
