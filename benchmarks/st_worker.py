"""Runs inside the tool venv that has torch and sentence-transformers
(llamax_dev.data: tool_venv(reference=True)) and measures
SentenceTransformer.encode.  JSON requests on stdin, one per line; JSON
answers on stdout.  Only the standard library, torch, numpy and
sentence_transformers are used here."""
import time

_models = {}


def embed(req):
    import torch
    from sentence_transformers import SentenceTransformer
    torch.set_num_threads(req["threads"])
    if req["model"] not in _models:
        _models[req["model"]] = SentenceTransformer(req["model"], device="cpu")
    st = _models[req["model"]]
    t0 = time.perf_counter()
    vecs = st.encode(req["sentences"], batch_size=req.get("batch_size", 32), normalize_embeddings=True,
                     convert_to_numpy=True)
    dt = time.perf_counter() - t0
    return {"seconds": dt, "vectors": vecs.tolist() if req.get("return_vectors") else None}


def serve():
    import sentence_transformers
    import torch
    from llamax_dev.worker_loop import serve as loop
    loop({"version": sentence_transformers.__version__, "torch": torch.__version__}, {"embed": embed})


if __name__ == "__main__":
    serve()
