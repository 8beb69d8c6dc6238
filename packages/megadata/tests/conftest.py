"""Puts this directory on sys.path so tests import their helper module `corpus_inputs`."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from corpus_inputs import english_documents


@pytest.fixture(scope="session")
def documents() -> list[dict]:
    return english_documents()
