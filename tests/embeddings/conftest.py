import json
from pathlib import Path

import numpy as np
import pytest

import llamax

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def sentences():
    return json.loads((HERE / "sentences.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def st_reference():
    """sentence-transformers' normalized vectors for sentences.json (make_refs.py)."""
    return np.load(HERE / "minilm_st_ref.npy")


@pytest.fixture(scope="module")
def embedder(minilm_f16):
    # max_seq_length 256: sentence-transformers' setting for all-MiniLM-L6-v2
    with llamax.Embedder(minilm_f16, max_seq_length=256, n_threads=2) as e:
        yield e
