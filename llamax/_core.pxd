# One cdef class per native object.  Each owns exactly one handle; children
# keep their parents alive (Context -> Model, LoraAdapter -> Model).
from libc.stdint cimport int32_t
from libcpp.memory cimport shared_ptr

from llamax.includes.llama cimport llama_model, llama_sampler, llama_vocab
from llamax.includes.shim cimport (CAdapter, CAdapterPtr, CContext, CControlVector, CControlVectorPtr, CModelPtr,
                                   CStatePtr)


cdef class Model:
    cdef llama_model * _model
    cdef CModelPtr _own        # the reference this object holds (adapters hold theirs)
    cdef const llama_vocab * _vocab
    cdef int32_t _unk              # [UNK] id (WPM fix-up), -1 if none
    cdef readonly str path
    cdef readonly bint vocab_only
    cdef readonly int n_gpu_layers  # as asked (-1: all); supports_gpu_offload() says whether any GPU runs them
    cdef readonly bint repack       # weights may be repacked for llama.cpp's CPU GEMM kernels
    cdef object _children      # weakref.WeakSet of Context / LoraAdapter / Sampler
    cdef int32_t _max_positions    # learned position embeddings: rows (n_ctx_train), else 0
    cdef int _busy             # calls running without the GIL (tokenize, ...): close() refuses
    cdef object __weakref__
    cdef llama_model * _ptr(self) except NULL


cdef class LoraAdapter:
    cdef CAdapterPtr _a        # null once closed (the adapter lives while a State holds it)
    cdef readonly Model model
    cdef readonly str path
    cdef object __weakref__
    cdef const CAdapter * _ptr(self) except NULL


cdef class ControlVector:
    cdef CControlVectorPtr _cv
    cdef readonly Model model
    cdef const CControlVector * _get(self) except NULL


cdef class State:
    cdef CStatePtr _st
    cdef readonly Model model
    cdef readonly tuple adapters        # ((LoraAdapter, scale), ...)
    cdef readonly ControlVector control_vector
    cdef object __weakref__


cdef class Sampler:
    cdef llama_sampler * _smpl
    cdef llama_sampler * _grammar  # the chain's grammar sampler (owned by the chain), or NULL
    cdef readonly Model model
    cdef readonly dict params
    cdef bint _in_use
    cdef bint _plain_greedy   # the chain is one greedy sampler: generate may argmax directly
    cdef object __weakref__
    cdef llama_sampler * _ptr(self) except NULL


cdef class Context:
    cdef CContext * _c
    cdef readonly Model model
    cdef int _busy            # Python-level users between GIL releases (see _enter)
    cdef int _n_views         # exported output views (logits / token embeddings)
    cdef int _n_seq_views     # exported pooled-embedding views
    cdef bint _close_pending  # close() ran while views were alive: free when the last goes
    cdef unsigned long _owner # thread inside a call (holds the lock), 0 if none: re-entrancy check
    cdef object _driver       # weakref to the Batcher that drives this context, or None
    cdef bint _driven(self)
    cdef State _state         # the applied state (the native context holds its own reference)
    cdef tuple _draft_stats   # (drafted, accepted, decodes) of the last generate()
    cdef readonly bint embeddings
    cdef object __weakref__
    cdef CContext * _get(self) except NULL
    cdef CContext * _enter(self, bint watch_sigint=*) except NULL
    cdef void _leave(self) noexcept
    cdef void _free(self) noexcept
