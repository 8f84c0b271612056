"""Compute the sentence-transformers reference vectors for the parity tests.

Run once by the tooling (not by the tests), in the cached venv that has
torch and sentence-transformers (llamax_dev.data: tool_venv):

    python tests/embeddings/make_refs.py

It writes minilm_st_ref.npy: float32 (len(sentences.json), 384), the
normalized vectors sentence-transformers' own all-MiniLM-L6-v2 pipeline
(max_seq_length 256, mean pooling, Normalize) gives for sentences.json.
"""
import os
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent

CHILD = r"""
import json, sys
import numpy as np
from sentence_transformers import SentenceTransformer
model_dir, sentences, out = sys.argv[1], sys.argv[2], sys.argv[3]
st = SentenceTransformer(model_dir, device="cpu")
vecs = st.encode(json.load(open(sentences)), convert_to_numpy=True, normalize_embeddings=True, batch_size=8)
np.save(out, vecs.astype(np.float32))
print(vecs.shape, st.max_seq_length)
"""


def main() -> None:
    from llamax_dev import data
    py = data.tool_venv(reference=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="2")
    subprocess.run([str(py), "-c", CHILD, str(data.minilm_dir()), str(HERE / "sentences.json"),
                    str(HERE / "minilm_st_ref.npy")], check=True, env=env)


if __name__ == "__main__":
    main()
