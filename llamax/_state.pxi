# Included by _core.pyx (one file per native class, as pyarrow's lib.pyx does).

# ---------------------------------------------------------------------------
# State: an adapter set with scales plus a control vector, interned

cdef State _make_state(Model model, adapters, control_vector, str what, State o=None):
    """Validate ``adapters`` ``[(LoraAdapter, scale), ...]`` and
    ``control_vector`` for ``model``, intern them, and fill ``o`` (a new
    State if None) with the result."""
    cdef vector[CAdapterPtr] ptrs
    cdef vector[float] scales
    cdef LoraAdapter a
    cdef ControlVector cv = None
    if isinstance(adapters, (str, bytes)) or not hasattr(adapters, "__iter__"):
        raise ArgumentTypeError(f"{what} takes a sequence of (LoraAdapter, scale) pairs, "
                                f"not {type(adapters).__name__}")
    keep = []
    for item in adapters:
        try:
            ad, scale = item
        except (TypeError, ValueError):
            raise ArgumentTypeError(f"{what} takes (LoraAdapter, scale) pairs") from None
        if not isinstance(ad, LoraAdapter):
            raise ArgumentTypeError(f"{what} takes LoraAdapter objects, not {type(ad).__name__}")
        _check_float(scale, "scale")
        a = ad
        if a.model is not model:
            raise InvalidArgumentError(f"adapter {a.path!r} was loaded for another model")
        a._ptr()  # closed: ClosedError
        ptrs.push_back(a._a)
        scales.push_back(scale)
        keep.append((a, float(scale)))
    if control_vector is not None:
        cv = _typed(control_vector, ControlVector, "control_vector")
        cv._get()
        if cv.model is not model:
            raise InvalidArgumentError("this control vector was made for another model")
    cdef CControlVectorPtr cvp
    if cv is not None:
        cvp = cv._cv
    cdef CStatePtr st = state_intern(model._ptr(), ptrs, scales, cvp)
    if o is None:
        o = State.__new__(State)
    o._st = st
    o.model = model
    o.adapters = tuple(keep)
    o.control_vector = cv
    model._children.add(o)
    return o


cdef class State:
    """What a context applies besides the model's weights: an ordered set of
    LoRA adapters with scales, and a control vector.

    ``State(model, adapters=[(LoraAdapter, scale), ...], control_vector=None)``.
    Immutable and interned: equal contents (the same adapter objects, equal
    scales, an equal control vector) share one native state and one ``id``
    while any holder keeps it, so applying the state a context already has
    is a pointer compare.  ``id`` is never reused; ``0`` is the base model.
    A state holds its adapters: closing a :class:`LoraAdapter` (or unloading
    it from a ``Llama``) frees it only once no state names it.
    """

    def __init__(self, model, adapters=(), control_vector=None):
        _make_state(_typed(model, Model, "model"), adapters, control_vector, "State()", self)

    @property
    def id(self):
        """The interned state's id (``0``: no adapters and no control vector)."""
        if self._st.get() == NULL:
            raise ClosedError("this State is closed")
        return self._st.get().id

    @property
    def is_base(self):
        return self.id == 0

    def close(self):
        """Let go of the native state (idempotent; its model's close() does it)."""
        self._st.reset()

    @property
    def closed(self):
        return self._st.get() == NULL

    def __eq__(self, other):
        if not isinstance(other, State):
            return NotImplemented
        return self._st.get() == (<State> other)._st.get() and self._st.get() != NULL

    def __hash__(self):
        return hash(self.id)

    def __repr__(self):
        if self._st.get() == NULL:
            return "<llamax.State closed>"
        parts = [f"{a.path!r}x{s:g}" for a, s in self.adapters]
        if self.control_vector is not None:
            parts.append("control_vector")
        return f"<llamax.State id={self.id} {' + '.join(parts) or 'base'}>"


def _n_interned_states():
    """Live interned states, the base one excluded (tests)."""
    return state_n_interned()
