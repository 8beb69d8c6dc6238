import sys
from pathlib import Path

import pytest

# Shared test helpers (eval_inputs.py) import by name.
sys.path.insert(0, str(Path(__file__).parent))

from eval_inputs import write_lambada, write_tiny_gpt2, write_wikitext


@pytest.fixture
def wikitext_file(tmp_path) -> Path:
    return write_wikitext(tmp_path / "wiki.test.tokens")


@pytest.fixture
def lambada_file(tmp_path) -> Path:
    return write_lambada(tmp_path / "lambada_test.jsonl")


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory) -> Path:
    """A random 2-layer GPT-2 with a BPE tokenizer trained on the test text (built once)."""
    return write_tiny_gpt2(tmp_path_factory.mktemp("tiny-gpt2"))
