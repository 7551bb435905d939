"""docs/settings.md documents every setting, the example env file names real settings, and what
sends a reader to docs/ finds it there."""

from __future__ import annotations

import re
from pathlib import Path

from app.core.settings import Settings

REPO = Path(__file__).resolve().parents[2]


def test_every_setting_is_in_the_settings_table() -> None:
    table = REPO / "docs" / "settings.md"
    documented = set(re.findall(r"^\| `(INFERQ_[A-Z0-9_]+)` \|", table.read_text(), re.M))
    fields = {f"INFERQ_{name.upper()}" for name in Settings.model_fields}
    assert fields - documented == set(), "settings missing from docs/settings.md"
    assert documented - fields == set(), "docs/settings.md documents settings that do not exist"


def test_env_example_names_real_settings() -> None:
    names = re.findall(r"^#?\s*(INFERQ_[A-Z0-9_]+)=", (REPO / ".env.example").read_text(), re.M)
    fields = {f"INFERQ_{name.upper()}" for name in Settings.model_fields}
    assert names and set(names) <= fields


def _texts() -> dict[str, str]:
    """Every file a reader or a comment may point from: docs, code, CI, deployment."""
    paths = [
        REPO / "README.md",
        REPO / "Dockerfile",
        REPO / "docker-compose.yml",
        *(REPO / ".ci").iterdir(),
        *(REPO / "docs").glob("*.md"),
        *(REPO / "deploy").rglob("*.yml"),
        *(p for folder in ("app", "workers", "migrations") for p in (REPO / folder).rglob("*.py")),
    ]
    return {str(p.relative_to(REPO)): p.read_text() for p in paths if p.is_file()}


def test_every_reference_to_docs_resolves() -> None:
    """A comment or a page that sends its reader to docs/... finds it there."""
    missing = {
        (where, ref)
        for where, text in _texts().items()
        for ref in re.findall(r"docs/[\w./-]+\.md", text)
        if not (REPO / ref).is_file()
    }
    assert missing == set()


def test_nothing_cites_a_design_file_outside_the_repository() -> None:
    citing = [
        where for where, text in _texts().items() if re.search(r"DESIGN\s*§|DESIGN\.md", text)
    ]
    assert citing == []
