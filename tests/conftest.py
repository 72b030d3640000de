"""Shared pytest fixtures: where the repository and the shared data (``../shared``) are."""

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DIR = REPO_ROOT.parent / "shared"


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The repository root."""
    return REPO_ROOT


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``../shared/data`` beside the repository; skips the test when it is absent."""
    data = SHARED_DIR / "data"
    if not data.is_dir():
        pytest.skip(f"shared data not found at {data} (it lives beside the repository, "
                    "see ../shared/README.md)")
    return data
