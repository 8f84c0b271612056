"""Exercise logits/embedding views across growing decodes, deferred close and
context death, for a memory checker:

    PYTHONMALLOC=malloc valgrind --error-exitcode=99 --errors-for-leak-kinds=none \
        python3 tools/memcheck_views.py MODEL.gguf

(or under an LLAMAX_SANITIZE=address build).  Every read of a live view must
hit valid memory; the script prints the sums it read.
"""
import gc
import sys


import llamax

m = llamax.Model(sys.argv[1])
c = llamax.Context(m, n_ctx=128, n_threads=2)
c.decode([1, 2, 3])
v1 = c.get_logits()                      # 1 row
total = float(v1.sum())
try:
    c.decode(list(range(1, 9)), logits="all")   # would grow: refused while v1 lives
    raise SystemExit("growth was not refused")
except llamax.ViewsExportedError:
    pass
total += float(v1.sum())
del v1
gc.collect()
c.decode(list(range(1, 9)), logits="all")       # grows now, no view alive
v8 = c.get_logits()
c.decode([9, 10], logits="all")                 # within capacity: same buffer
total += float(v8[:2].sum())
c.close()                                       # deferred: v8 still reads the buffer
total += float(v8.sum())
del v8, c
gc.collect()                                    # freed here
e = llamax.Context(m, n_ctx=64, n_seq_max=2, n_threads=2, embeddings=True, pooling="mean")
e.decode([1, 2, 3, 4], seq_ids=[0, 0, 1, 1], pos=[0, 1, 0, 1], logits="all")
s0 = e.get_embeddings_seq(0)
try:
    e.decode([5])
    raise SystemExit("decode with a pooled view alive was not refused")
except llamax.ViewsExportedError:
    pass
total += float(s0.sum())
del s0, e
gc.collect()
m.close()
print("ok", total)
