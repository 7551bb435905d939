"""The README documents every setting, and the example env file names real settings."""

from __future__ import annotations

import re
from pathlib import Path

from app.core.settings import Settings

REPO = Path(__file__).resolve().parents[2]


def test_every_setting_is_in_the_readme_table() -> None:
    readme = REPO / "README.md"
    documented = set(re.findall(r"^\| `(INFERQ_[A-Z0-9_]+)` \|", readme.read_text(), re.M))
    fields = {f"INFERQ_{name.upper()}" for name in Settings.model_fields}
    assert fields - documented == set(), "settings missing from the README table"
    assert documented - fields == set(), "README documents settings that do not exist"


def test_env_example_names_real_settings() -> None:
    names = re.findall(r"^#?\s*(INFERQ_[A-Z0-9_]+)=", (REPO / ".env.example").read_text(), re.M)
    fields = {f"INFERQ_{name.upper()}" for name in Settings.model_fields}
    assert names and set(names) <= fields
