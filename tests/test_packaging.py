"""What a user installs: the wheel built from this checkout holds every module of the package and the
``py.typed`` marker, so that type checkers read rlharvest's type hints (PEP 561)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(120)
def test_the_wheel_holds_every_module_and_the_typed_marker(tmp_path):
    source = tmp_path / "source"  # a copy: building writes build/ and *.egg-info next to the sources
    shutil.copytree(ROOT / "rlharvest", source / "rlharvest", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    build = "import sys; from setuptools import build_meta; build_meta.build_wheel(sys.argv[1])"
    subprocess.run([sys.executable, "-c", build, str(tmp_path / "dist")], cwd=source, check=True,
                   capture_output=True, timeout=100)
    (wheel,) = (tmp_path / "dist").glob("rlharvest-*.whl")
    packaged = set(zipfile.ZipFile(wheel).namelist())
    files = {path.relative_to(source).as_posix() for path in (source / "rlharvest").rglob("*") if path.is_file()}
    assert "rlharvest/py.typed" in files and (ROOT / "rlharvest" / "py.typed").read_bytes() == b""
    assert not files - packaged, f"the wheel leaves out {sorted(files - packaged)}"
