"""The package as pip builds it: an editable install with no warning, and a wheel of our four
packages only.

The editable build runs setuptools' own PEP 660 hook (``build_meta.build_editable``, what pip
calls) in a child process. With the flat layout and no ``package-dir``, setuptools installed a
meta path finder and warned on every install ("Please be careful with folders in your working
directory with the same name as your package..."); ``package-dir = {"" = "."}`` in
pyproject.toml makes it a plain ``.pth`` of the checkout, which it builds silently
(docs/development.md, "Packaging").
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

BUILD = """
import sys
from setuptools import build_meta
print(build_meta.{hook}(sys.argv[1]))
"""


@pytest.fixture(autouse=True)
def _no_build_dir_left() -> Iterator[None]:
    """setuptools builds in the checkout's build/: it goes again unless it was there before."""
    existed = (ROOT / "build").exists()
    yield
    if not existed:
        shutil.rmtree(ROOT / "build", ignore_errors=True)


def _build(hook: str, out: Path) -> tuple[Path, str]:
    done = subprocess.run(
        [sys.executable, "-W", "default", "-c", BUILD.format(hook=hook), str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out / done.stdout.strip().splitlines()[-1], done.stderr


def test_an_editable_install_builds_without_a_warning(tmp_path: Path) -> None:
    wheel, stderr = _build("build_editable", tmp_path)
    assert "Editable installation" not in stderr and "Please be careful" not in stderr, stderr
    with zipfile.ZipFile(wheel) as z:
        pth = [n for n in z.namelist() if n.endswith(".pth")]
        assert len(pth) == 1, z.namelist()
        # The checkout itself on sys.path: app, workers, migrations and bench import from it.
        assert Path(z.read(pth[0]).decode().strip()) == ROOT


def test_the_wheel_holds_our_packages_only(tmp_path: Path) -> None:
    wheel, _ = _build("build_wheel", tmp_path)
    with zipfile.ZipFile(wheel) as z:
        top = {name.split("/")[0] for name in z.namelist()}
        assert "migrations/script.py.mako" in z.namelist()
    assert top == {"app", "workers", "migrations", "bench", "inferq-0.1.0.dist-info"}
