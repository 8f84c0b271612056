"""all-MiniLM-L6-v2 on ONNX Runtime, the way a performance-minded embedding
service runs it: the model exported to ONNX fp32 by torch.onnx, a session
with ORT_ENABLE_ALL and N intra-op threads, the Hugging Face fast tokenizer
(the `tokenizers` library; padding to the longest input of each batch,
truncation at 256 tokens), mean pooling and L2 normalization in numpy.

  python ort_worker.py export HF_DIR OUT.onnx   (in the tool venv: torch + onnx)
  python ort_worker.py serve                    (in the ORT venv: onnxruntime, tokenizers, numpy)

serve reads JSON requests on stdin, one per line, and answers on stdout."""
import sys
import time
from pathlib import Path

_sessions = {}


def export(src: str, out: str) -> None:
    """Export the Hugging Face model in `src` to ONNX fp32 (dynamic batch and
    sequence axes) at `out`; done once, the benchmark caches the file."""
    import torch
    from transformers import AutoModel
    model = AutoModel.from_pretrained(src).eval()
    x = torch.ones(2, 16, dtype=torch.long)
    names = ["input_ids", "attention_mask", "token_type_ids"]
    tmp = out + ".part"
    torch.onnx.export(model, (x, x, torch.zeros_like(x)), tmp, input_names=names,
                      output_names=["last_hidden_state"],
                      dynamic_axes={k: {0: "batch", 1: "seq"} for k in names + ["last_hidden_state"]},
                      opset_version=17, dynamo=False)
    Path(tmp).replace(out)


def session(onnx_path: str, tok_dir: str, threads: int, max_len: int):
    key = (onnx_path, tok_dir, threads, max_len)
    if key not in _sessions:
        import onnxruntime as ort
        from tokenizers import Tokenizer
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        sess = ort.InferenceSession(onnx_path, so, providers=["CPUExecutionProvider"])
        tok = Tokenizer.from_file(str(Path(tok_dir) / "tokenizer.json"))
        tok.enable_truncation(max_length=max_len)
        tok.enable_padding(pad_id=tok.token_to_id("[PAD]"), pad_token="[PAD]")
        _sessions[key] = (sess, tok)
    return _sessions[key]


def embed(req):
    import numpy as np
    sess, tok = session(req["onnx"], req["tokenizer"], req["threads"], req.get("max_seq_length", 256))
    texts = req["sentences"]
    bs = req.get("batch_size", 32)
    t0 = time.perf_counter()
    out = []
    for i in range(0, len(texts), bs):
        enc = tok.encode_batch(texts[i:i + bs])
        feeds = {"input_ids": np.array([e.ids for e in enc], np.int64),
                 "attention_mask": np.array([e.attention_mask for e in enc], np.int64),
                 "token_type_ids": np.array([e.type_ids for e in enc], np.int64)}
        h = sess.run(None, feeds)[0]
        m = feeds["attention_mask"][:, :, None].astype(np.float32)
        v = (h * m).sum(1) / np.maximum(m.sum(1), 1e-9)
        out.append(v / np.linalg.norm(v, axis=1, keepdims=True))
    vecs = np.concatenate(out)
    dt = time.perf_counter() - t0
    return {"seconds": dt, "vectors": vecs.tolist() if req.get("return_vectors") else None}


def serve():
    import onnxruntime
    import tokenizers
    from llamax_dev.worker_loop import serve as loop
    loop({"version": onnxruntime.__version__, "tokenizers": tokenizers.__version__}, {"embed": embed})


if __name__ == "__main__":
    if sys.argv[1:2] == ["export"] and len(sys.argv) == 4:
        export(sys.argv[2], sys.argv[3])
    else:
        serve()
