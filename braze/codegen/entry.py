"""The native code of braze_entry and braze_body (entry.py): the guard, and the body that runs a
program natively or through its Python body, generic over programs: everything program-specific
is read from the descriptor (entry.Descriptor) each is given. Built once per process."""

from __future__ import annotations

from collections.abc import Callable

import llvmlite.ir as ll

from ..entry import (
    HOOK_WORDS,
    INDEX_ERROR,
    INT_SYMBOL_WORDS,
    MAX_DIMS,
    MODULE_WORDS,
    MXCSR_FLUSH,
    NULL,
    OOM_ERROR,
    OUTPUT_WORDS,
    OWNER_WORDS,
    PACK_WORDS,
    PY_EQ,
    SCRATCH_WORDS,
    SYMBOL_WORDS,
    TENSOR_WORDS,
    UNBOUND,
    VERSION_WORDS,
    W,
)
from ..jit import (
    DEFAULT_DTYPE,
    DICT_VERSION_OFFSET,
    FLASH_ENABLED,
    FN_MODE,
    FP32_PRECISION,
    GLOBAL_CONTEXT,
    KEYSET_OFFSET,
    MATMUL,
    MKL_THREADS,
    MKLDNN,
    MKLDNN_ENABLED,
    REQUIRES_GRAD,
    TENSOR_OFFSET,
    TLS_GUARD,
    TLS_GUARD_END,
    WRAP,
    shim_constant,
    version_offsets,
)
from . import I1, I8, I32, I64, OUT_OF_MEMORY, PTR, VOID, ModuleBuilder, counted_loop

HUGE_PAGE, MADV_HUGEPAGE = 2 << 20, 14  # (Linux x86-64)


def _aligned(b: ll.IRBuilder, nbytes: ll.Value) -> ll.Value:
    """nbytes rounded up to 64 (each scratch buffer starts on a cache line)."""
    return b.and_(b.add(nbytes, I64(63)), I64(-64))


class _Callee:
    """A function pointer as a call target (llvmlite's call reads the callee's function type)."""

    def __init__(self, value: ll.Value, function_type: ll.FunctionType) -> None:
        self.value, self.function_type, self.type = value, function_type, PTR

    def get_reference(self) -> str:
        return self.value.get_reference()


class Runtime:
    """Emits braze_entry and braze_body, which read everything program-specific from the
    descriptor they are given."""

    def __init__(self, mb: ModuleBuilder) -> None:
        self.mb = mb
        d = mb.declare
        self.vectorcall = d("PyObject_Vectorcall", PTR, [PTR, PTR, I64, PTR])
        self.getattr = d("PyObject_GetAttr", PTR, [PTR, PTR])
        self.decref = d("Py_DecRef", VOID, [PTR])  # Py_XDECREF: NULL is fine
        self.data_ptr = d("aoti_torch_get_data_ptr", I32, [PTR, PTR])
        self.delete = d("aoti_torch_delete_tensor_object", I32, [PTR])

    def emit(self) -> None:
        run = self._run()
        self._body(run)
        self._entry(run)
        mxcsr = ll.Function(self.mb.module, ll.FunctionType(I32, []), "braze_mxcsr")
        b = ll.IRBuilder(mxcsr.append_basic_block("entry"))
        b.ret(self._mxcsr(b))

    # --- reading the descriptor --------------------------------------------------------------
    @staticmethod
    def word(b: ll.IRBuilder, base: ll.Value, index: ll.Value | int, ty: ll.Type = I64) -> ll.Value:
        i = I64(index) if isinstance(index, int) else index
        return b.load(b.gep(base, [i], source_etype=I64), typ=ty)

    def field(self, b: ll.IRBuilder, d: ll.Value, name: str, ty: ll.Type = I64) -> ll.Value:
        return self.word(b, d, W[name], ty)

    def record(self, b: ll.IRBuilder, d: ll.Value, name: str, i: ll.Value, words: tuple[str, ...]) -> Callable:
        """Accessor for word `w` of record `i` of the array `name`."""
        base = self.field(b, d, name, PTR)
        start = b.mul(i, I64(len(words)))
        return lambda w, ty=I64: self.word(b, base, b.add(start, I64(words.index(w))), ty)

    @staticmethod
    def item(b: ll.IRBuilder, array: ll.Value, i: ll.Value | int) -> ll.Value:
        return b.gep(array, [I64(i) if isinstance(i, int) else i], source_etype=PTR)

    # --- braze_entry: the guard --------------------------------------------------------------
    def _entry(self, run: ll.Function) -> None:
        fn = ll.Function(self.mb.module, ll.FunctionType(PTR, [PTR, PTR, I64, PTR]), "braze_entry")
        d, args, nargs, kwnames = fn.args
        b = ll.IRBuilder(fn.append_basic_block("entry"))
        miss = fn.append_basic_block("miss")
        table = b.alloca(PTR, size=self.field(b, d, "n_slots"))  # the guard reads data pointers into it

        def require(ok: ll.Value) -> None:
            nxt = fn.append_basic_block("ok")
            b.cbranch(ok, nxt, miss)
            b.position_at_end(nxt)

        f = lambda name, ty=I64: self.field(b, d, name, ty)  # noqa: E731
        given = args  # the call's own arguments, which a miss passes on as they came
        args = self._keywords(b, d, args, nargs, kwnames, require)
        nargs = f("n_args")
        require(b.icmp_signed("==", b.load(f("epoch", PTR), typ=I64), f("epoch_value")))
        self._check_consts(b, d, args, require)
        self._check_dispatch_state(b, d, require)
        require(self._denormals_kept(b))
        grad_mode = b.call(self.mb.declare("aoti_torch_grad_mode_is_enabled", I1, []), [])
        with counted_loop(b, I64(0), f("n_symbols")) as i:
            sym = self.record(b, d, "symbols", i, SYMBOL_WORDS)
            b.store(I64(UNBOUND), self.item(b, table, sym("slot")))
        with counted_loop(b, I64(0), f("n_tensors")) as i:
            self._check_layout(b, d, args, i, table, require)
        with counted_loop(b, I64(0), f("n_int_symbols")) as i:
            self._bind_int(b, d, args, i, table, require)
        with counted_loop(b, I64(0), f("n_symbols")) as i:
            sym = self.record(b, d, "symbols", i, SYMBOL_WORDS)
            value = b.load(self.item(b, table, sym("slot")), typ=I64)
            require(b.and_(b.icmp_signed(">=", value, sym("lo")), b.icmp_signed("<=", value, sym("hi"))))
        self._dims(b, d, table)
        with counted_loop(b, I64(0), f("n_tensors")) as i:
            self._check_tensor(b, d, args, i, table, grad_mode, require)
        with counted_loop(b, I64(0), f("n_modules")) as i:
            self._check_training(b, d, i, require)
        with counted_loop(b, I64(0), f("n_owners")) as i:
            self._check_owner(b, d, i, require)
        with counted_loop(b, I64(0), f("n_packs")) as i:
            self._check_pack(b, d, args, i, require)
        size = self.mb.declare("PyDict_Size", I64, [PTR])
        with counted_loop(b, I64(0), f("n_hooks")) as i:  # no forward hook added or removed
            h = self.record(b, d, "hooks", i, HOOK_WORDS)
            require(b.icmp_signed("==", b.call(size, [h("table", PTR)]), h("count")))
        with counted_loop(b, I64(0), f("n_versions")) as i:  # no layer's attribute set since
            v = self.record(b, d, "versions", i, VERSION_WORDS)
            tag = b.load(b.gep(v("dict", PTR), [I64(DICT_VERSION_OFFSET)], source_etype=I8), typ=I64)
            require(b.icmp_unsigned("==", tag, v("version")))
        fn_mode = b.call(self.mb.declare(FN_MODE, I8, []), [])
        require(b.icmp_unsigned("==", fn_mode, I8(0)))
        dtype = b.sext(b.call(self.mb.declare(DEFAULT_DTYPE, I8, []), []), I64)
        require(b.icmp_signed("==", dtype, f("default_dtype")))
        self._check_settings(b, d, require)
        self._python_body(b, d, args, nargs)
        b.ret(b.call(run, [d, table, args, nargs]))
        b.position_at_end(miss)
        b.call(self.mb.declare("PyErr_Clear", VOID, []), [])
        b.ret(b.call(self.vectorcall, [f("on_miss", PTR), given, fn.args[2], kwnames]))

    def _keywords(
        self, b: ll.IRBuilder, d: ll.Value, args: ll.Value, nargs: ll.Value, kwnames: ll.Value, require: Callable
    ) -> ll.Value:
        """The call's arguments in positional order: keyword arguments that name parameters
        (the descriptor's `names`, compared by identity: CPython interns the names a call site
        writes) put in their places; every parameter given once, none left to a default (a call
        that leaves one out takes the slow path, which fills in the defaults)."""
        n_args = self.field(b, d, "n_args")
        with b.goto_entry_block():
            bound = b.alloca(PTR, size=self.field(b, d, "n_args"))
        n_kw = self._alloca(b, I64)
        b.store(I64(0), n_kw)
        with b.if_then(b.icmp_unsigned("!=", kwnames, NULL)):
            b.store(b.call(self.mb.declare("PyTuple_Size", I64, [PTR]), [kwnames]), n_kw)
        keywords = b.load(n_kw, typ=I64)
        require(b.icmp_signed("==", b.add(nargs, keywords), n_args))
        names = self.field(b, d, "names", PTR)
        with b.if_then(b.icmp_signed(">", keywords, I64(0))):
            require(b.icmp_signed("==", self.field(b, d, "n_names"), n_args))
            with counted_loop(b, I64(0), n_args) as k:
                given = b.select(b.icmp_signed("<", k, nargs), b.load(self.item(b, args, k), typ=PTR), NULL)
                b.store(given, self.item(b, bound, k))
            with counted_loop(b, I64(0), keywords) as k:
                name = b.call(self.mb.declare("PyTuple_GetItem", PTR, [PTR, I64]), [kwnames, k])
                found = self._alloca(b, I64)
                b.store(I64(-1), found)
                with counted_loop(b, I64(0), n_args) as p:
                    same = b.icmp_unsigned("==", self.word(b, names, p, PTR), name)
                    b.store(b.select(same, p, b.load(found, typ=I64)), found)
                at = b.load(found, typ=I64)
                require(b.icmp_signed(">=", at, nargs))  # a parameter not given positionally (-1: none)
                require(b.icmp_unsigned("==", b.load(self.item(b, bound, at), typ=PTR), NULL))
                b.store(b.load(self.item(b, args, b.add(nargs, k)), typ=PTR), self.item(b, bound, at))
        return b.select(b.icmp_signed(">", keywords, I64(0)), bound, args)

    def _bind_int(
        self, b: ll.IRBuilder, d: ll.Value, args: ll.Value, i: ll.Value, table: ll.Value, require: Callable | None
    ) -> None:
        """Int argument i of a generic program (a TorchDynamo graph's symbolic size): an int
        (checked, unless `require` is None) whose value binds its symbol or equals the value bound."""
        sym = self.record(b, d, "int_symbols", i, INT_SYMBOL_WORDS)
        obj = b.load(self.item(b, args, sym("pos")), typ=PTR)
        if require is not None:
            ob_type = b.load(b.gep(obj, [I64(8)], source_etype=I8), typ=PTR)
            require(b.icmp_unsigned("==", ob_type, self.field(b, d, "int_type", PTR)))
        value = b.call(self.mb.declare("PyLong_AsLongLong", I64, [PTR]), [obj])
        self._bind(b, self.item(b, table, sym("slot")), value, require)

    def _bind(self, b: ll.IRBuilder, bound: ll.Value, value: ll.Value, require: Callable | None) -> None:
        """Store `value` as a symbol's (the first place that names it), or require it equal to
        the value stored; unchecked (require None), store it."""
        if require is None:
            b.store(value, bound)
            return
        before = b.load(bound, typ=I64)
        b.store(b.select(b.icmp_signed("==", before, I64(UNBOUND)), value, before), bound)
        require(b.icmp_signed("==", value, b.load(bound, typ=I64)))

    def resolve(self, b: ll.IRBuilder, table: ll.Value, word: ll.Value) -> ll.Value:
        """A size or stride word's value: itself, or the table's value that it refers to (ref)."""
        referred = b.icmp_signed("<", word, I64(0))
        slot = b.select(referred, b.sub(I64(-1), word), I64(0))
        return b.select(referred, b.load(self.item(b, table, slot), typ=I64), word)

    def _dims(self, b: ll.IRBuilder, d: ll.Value, table: ll.Value) -> None:
        """A generic program's values computed from its symbols, into the table."""
        dims = self.field(b, d, "dims", PTR)
        with b.if_then(b.icmp_unsigned("!=", dims, NULL)):
            b.call(_Callee(dims, ll.FunctionType(VOID, [PTR])), [table])

    def _check_consts(self, b: ll.IRBuilder, d: ll.Value, args: ll.Value, require: Callable) -> None:
        """type(arg) is type(value) and arg == value, for each specialised Python argument."""
        cmp = self.mb.declare("PyObject_RichCompareBool", I32, [PTR, PTR, I32])
        with counted_loop(b, I64(0), self.field(b, d, "n_consts")) as i:
            arg = b.load(self.item(b, args, self.word(b, self.field(b, d, "const_pos", PTR), i)), typ=PTR)
            ob_type = b.load(b.gep(arg, [I64(8)], source_etype=I8), typ=PTR)
            require(b.icmp_unsigned("==", ob_type, self.word(b, self.field(b, d, "const_types", PTR), i, PTR)))
            value = self.word(b, self.field(b, d, "const_values", PTR), i, PTR)
            require(b.icmp_signed("==", b.call(cmp, [arg, value, I32(PY_EQ)]), I32(1)))

    def _check_training(self, b: ll.IRBuilder, d: ll.Value, i: ll.Value, require: Callable) -> None:
        """Module i's `training` is the object (True or False) it was when compiled."""
        m = self.record(b, d, "modules", i, MODULE_WORDS)
        obj, name = m("obj", PTR), self.field(b, d, "training", PTR)
        found = self._alloca(b, PTR)
        with b.if_else(b.icmp_signed("==", m("lookup"), I64(0))) as (in_dict, by_getattr):
            with in_dict:  # a borrowed reference, or NULL (no dict, no entry: then a miss)
                slot = b.call(self.mb.declare("_PyObject_GetDictPtr", PTR, [PTR]), [obj])
                d_ = b.load(slot, typ=PTR)
                get = self.mb.declare("PyDict_GetItemWithError", PTR, [PTR, PTR])
                b.store(NULL, found)
                with b.if_then(b.icmp_unsigned("!=", d_, NULL)):
                    b.store(b.call(get, [d_, name]), found)
            with by_getattr:
                value = b.call(self.getattr, [obj, name])
                b.call(self.decref, [value])  # compared by identity (True, False) only
                b.store(value, found)
        require(b.icmp_unsigned("==", b.load(found, typ=PTR), m("expected", PTR)))

    def _check_owner(self, b: ll.IRBuilder, d: ll.Value, i: ll.Value, require: Callable) -> None:
        """Owner record i: its module still registers, under its name, the parameter the tensor
        record reads (rebind keeps the record's object the one registered now)."""
        o = self.record(b, d, "owners", i, OWNER_WORDS)
        get = self.mb.declare("PyDict_GetItemWithError", PTR, [PTR, PTR])
        registered = b.call(get, [o("table", PTR), o("name", PTR)])  # borrowed, or NULL
        t = self.record(b, d, "tensors", o("tensor"), TENSOR_WORDS)
        require(b.icmp_unsigned("==", registered, t("obj", PTR)))

    def _check_pack(self, b: ll.IRBuilder, d: ll.Value, args: ll.Value, i: ll.Value, require: Callable) -> None:
        """Pack record i: its tensor is the one packed, at the same data pointer, with the same
        version counter at the same count (`t._version`: no in-place change since)."""
        p = self.record(b, d, "packs", i, PACK_WORDS)
        obj = self._tensor_object(b, args, self.record(b, d, "tensors", p("tensor"), TENSOR_WORDS))
        require(b.icmp_unsigned("==", obj, p("obj", PTR)))
        h = b.gep(obj, [I64(TENSOR_OFFSET)], source_etype=I8)
        data = self._alloca(b, PTR)
        b.call(self.data_ptr, [h, data])
        require(b.icmp_unsigned("==", b.load(data, typ=PTR), p("data", PTR)))
        at, count = version_offsets() or (0, 0)  # (without them no program has packs)
        counter = b.load(b.gep(b.load(h, typ=PTR), [I64(at)], source_etype=I8), typ=PTR)
        require(b.icmp_unsigned("==", counter, p("counter", PTR)))  # (a packed tensor has one)
        value = b.load(b.gep(counter, [I64(count)], source_etype=I8), typ=I32)
        require(b.icmp_unsigned("==", b.zext(value, I64), p("count")))

    def _check_settings(self, b: ll.IRBuilder, d: ll.Value, require: Callable) -> None:
        """The process's settings the program's bits depend on are as compiled (a field of -1:
        the program depends on no such setting): ATen's float32 matmul precision its GEMMs were
        compiled for; MKL's thread count its one-thread GEMMs and braze's own GEMM kernels were
        probed at (on another count, eager's GEMMs may give other bits); torch.backends.mkldnn's
        flag, where its GELU is the oneDNN kernel's (which eager runs only while enabled) or its
        convolutions follow the path ATen takes with the flag as compiled; ATen's flash attention
        enabled, where its attention is that kernel's (without it eager runs the math one)."""
        context = lambda: b.call(self.mb.declare(GLOBAL_CONTEXT, PTR, []), [])  # noqa: E731
        precision = self.mb.declare(FP32_PRECISION, I32, [PTR, I32, I32])
        reads = {
            "matmul_precision": lambda: b.call(precision, [context(), I32(MKLDNN), I32(MATMUL)]),
            "mkl_threads": lambda: b.call(self.mb.declare(MKL_THREADS, I32, []), []),
            "mkldnn": lambda: b.call(self.mb.declare(MKLDNN_ENABLED, I8, [PTR]), [context()]),
            "flash": lambda: b.call(self.mb.declare(FLASH_ENABLED, I8, [PTR]), [context()]),
        }
        for field, read in reads.items():
            want = self.field(b, d, field)
            with b.if_then(b.icmp_signed(">=", want, I64(0))):
                require(b.icmp_signed("==", b.sext(read(), I64), want))

    def _denormals_kept(self, b: ll.IRBuilder) -> ll.Value:
        """Whether this thread's MXCSR keeps denormals (no flush to zero, no denormals as zero:
        torch.set_flush_denormal(False)). With them flushed, eager's ops that set their own
        (MKL's vector math keeps denormals) and those that do not disagree with braze's fused
        loops: the call runs eagerly (signatures.unusual_state)."""
        flushing = b.and_(self._mxcsr(b), I32(MXCSR_FLUSH))
        return b.icmp_unsigned("==", flushing, I32(0))

    def _mxcsr(self, b: ll.IRBuilder) -> ll.Value:
        """This thread's MXCSR."""
        word = self._alloca(b, I32)
        b.call(self.mb.declare("llvm.x86.sse.stmxcsr", VOID, [PTR]), [word])
        return b.load(word, typ=I32)

    def _check_dispatch_state(self, b: ll.IRBuilder, d: ll.Value, require: Callable) -> None:
        """This thread's dispatch state is as compiled: no dispatch mode, functorch transform or
        autocast that eager would run the ops through; the same inference mode."""
        guard = self._alloca(b, ll.ArrayType(I64, 2))
        b.call(self.mb.declare(TLS_GUARD, VOID, [PTR, I64]), [guard, I64(0)])
        state = b.load(guard, typ=PTR)
        included, excluded = self.word(b, state, 0), self.word(b, state, 1)
        b.call(self.mb.declare(TLS_GUARD_END, VOID, [PTR]), [guard])
        require(b.icmp_unsigned("==", included, self.field(b, d, "tls_included")))
        require(b.icmp_unsigned("==", excluded, self.field(b, d, "tls_excluded")))

    def _tensor_object(self, b: ll.IRBuilder, args: ll.Value, t: Callable) -> ll.Value:
        """The tensor of record `t`: its argument, or the parameter object it holds."""
        obj = self._alloca(b, PTR)
        b.store(t("obj", PTR), obj)
        pos = t("pos")
        with b.if_then(b.icmp_signed(">=", pos, I64(0))):
            b.store(b.load(self.item(b, args, pos), typ=PTR), obj)
        return b.load(obj, typ=PTR)

    def _check_layout(
        self, b: ll.IRBuilder, d: ll.Value, args: ll.Value, i: ll.Value, table: ll.Value, require: Callable
    ) -> None:
        """Tensor i's type, dispatch keys (so device, layout, and no lazy negation or functorch
        wrapper), dtype and sizes as compiled; a size that names a symbol binds it, or must
        equal the value bound."""
        t = self.record(b, d, "tensors", i, TENSOR_WORDS)
        obj = self._tensor_object(b, args, t)
        h = b.gep(obj, [I64(TENSOR_OFFSET)], source_etype=I8)  # the at::Tensor: its first word is the impl
        with b.if_then(b.icmp_signed("!=", t("layout"), I64(0))):
            require(b.icmp_unsigned("==", b.load(b.gep(obj, [I64(8)], source_etype=I8), typ=PTR), t("type", PTR)))
            keys = b.load(b.gep(b.load(h, typ=PTR), [I64(KEYSET_OFFSET)], source_etype=I8), typ=I64)
            require(b.icmp_unsigned("==", keys, t("keys")))
            out = self._alloca(b, I64)
            b.store(I64(0), out)  # the getter writes an int32 into it
            b.call(self.mb.declare("aoti_torch_get_dtype", I32, [PTR, PTR]), [h, out])
            require(b.icmp_signed("==", b.load(out, typ=I64), t("dtype")))
            b.call(self.mb.declare("aoti_torch_get_dim", I32, [PTR, PTR]), [h, out])
            ndim = t("ndim")
            require(b.icmp_signed("==", b.load(out, typ=I64), ndim))
            b.call(self.mb.declare("aoti_torch_get_sizes", I32, [PTR, PTR]), [h, out])
            have, want = b.load(out, typ=PTR), t("sizes", PTR)
            with counted_loop(b, I64(0), ndim) as k:
                size, word = self.word(b, have, k), self.word(b, want, k)
                with b.if_else(b.icmp_signed("<", word, I64(0))) as (symbolic, fixed):
                    with symbolic:
                        self._bind(b, self.item(b, table, b.sub(I64(-1), word)), size, require)
                    with fixed:
                        require(b.icmp_signed("==", size, word))

    def _check_tensor(
        self,
        b: ll.IRBuilder,
        d: ll.Value,
        args: ll.Value,
        i: ll.Value,
        table: ll.Value,
        grad_mode: ll.Value,
        require: Callable,
    ) -> None:
        """Tensor i's strides as compiled, and memory behind it (its data pointer goes into the
        table); and, in grad mode, it does not require grad (autograd needs eager); where the
        program is for its requires_grad (a `grad` word of 0 or 1), that it is as compiled."""
        t = self.record(b, d, "tensors", i, TENSOR_WORDS)
        obj = self._tensor_object(b, args, t)
        h = b.gep(obj, [I64(TENSOR_OFFSET)], source_etype=I8)
        with b.if_then(b.icmp_signed("!=", t("layout"), I64(0))):
            out = self._alloca(b, I64)
            b.call(self.mb.declare("aoti_torch_get_strides", I32, [PTR, PTR]), [h, out])
            have, want = b.load(out, typ=PTR), t("strides", PTR)
            with counted_loop(b, I64(0), t("ndim")) as k:
                require(b.icmp_signed("==", self.word(b, have, k), self.resolve(b, table, self.word(b, want, k))))
            slot = t("slot")
            into = b.select(b.icmp_signed(">=", slot, I64(0)), self.item(b, table, slot), out)
            b.call(self.data_ptr, [h, into])
            empty = b.icmp_signed("==", t("nonempty"), I64(0))
            require(b.or_(empty, b.icmp_unsigned("!=", b.load(into, typ=PTR), NULL)))
        requires_grad = lambda: b.call(self.mb.declare(REQUIRES_GRAD, I8, [PTR]), [b.load(h, typ=PTR)])  # noqa: E731
        with b.if_then(grad_mode):
            require(b.icmp_unsigned("==", requires_grad(), I8(0)))
        want = t("grad")
        with b.if_then(b.icmp_signed(">=", want, I64(0))):
            require(b.icmp_signed("==", b.zext(requires_grad(), I64), want))

    # --- braze_body and braze_run ----------------------------------------------------------
    def _python_body(self, b: ll.IRBuilder, d: ll.Value, args: ll.Value, nargs: ll.Value) -> None:
        """A program with ATen calls: return what its generated Python body returns."""
        py_body = self.field(b, d, "py_body", PTR)
        with b.if_then(b.icmp_unsigned("!=", py_body, NULL)):
            b.ret(b.call(self.vectorcall, [py_body, args, nargs, NULL]))

    def _body(self, run: ll.Function) -> None:
        fn = ll.Function(self.mb.module, ll.FunctionType(PTR, [PTR, PTR, I64]), "braze_body")
        d, args, nargs = fn.args
        b = ll.IRBuilder(fn.append_basic_block("entry"))
        self._python_body(b, d, args, nargs)
        table = b.alloca(PTR, size=self.field(b, d, "n_slots"))
        with counted_loop(b, I64(0), self.field(b, d, "n_tensors")) as k:
            t = self.record(b, d, "tensors", k, TENSOR_WORDS)
            handle = b.gep(self._tensor_object(b, args, t), [I64(TENSOR_OFFSET)], source_etype=I8)
            with b.if_then(b.icmp_signed(">=", t("slot"), I64(0))):
                b.call(self.data_ptr, [handle, self.item(b, table, t("slot"))])
            with b.if_then(b.icmp_signed("!=", t("layout"), I64(0))):  # bind the symbols, unchecked
                sizes = self._alloca(b, PTR)
                b.call(self.mb.declare("aoti_torch_get_sizes", I32, [PTR, PTR]), [handle, sizes])
                have, want = b.load(sizes, typ=PTR), t("sizes", PTR)
                with counted_loop(b, I64(0), t("ndim")) as i:
                    word = self.word(b, want, i)
                    with b.if_then(b.icmp_signed("<", word, I64(0))):
                        self._bind(b, self.item(b, table, b.sub(I64(-1), word)), self.word(b, have, i), None)
        with counted_loop(b, I64(0), self.field(b, d, "n_int_symbols")) as i:
            self._bind_int(b, d, args, i, table, None)
        self._dims(b, d, table)
        b.ret(b.call(run, [d, table, args, nargs]))

    def _run(self) -> ll.Function:
        """braze_run(descriptor, table, args, nargs): the table holds the arguments' and
        parameters' data pointers (and a generic program's sizes); allocate the outputs, point
        at the scratch buffers, run the kernels, return the outputs (where an ATen call of the
        run failed: what the descriptor's `retry` returns for the arguments)."""
        fn = ll.Function(self.mb.module, ll.FunctionType(PTR, [PTR, PTR, PTR, I64]), "braze_run")
        fn.linkage = "internal"
        d, table, args, nargs = fn.args
        b = ll.IRBuilder(fn.append_basic_block("entry"))
        f = lambda name, ty=I64: self.field(b, d, name, ty)  # noqa: E731
        memo = self._memo(b, d, table, args, nargs)
        n_out = f("n_outputs")
        handles = b.alloca(PTR, size=n_out)
        oom = fn.append_basic_block("oom")
        with counted_loop(b, I64(0), n_out) as k:
            b.store(NULL, self.item(b, handles, k))
        with counted_loop(b, I64(0), n_out) as k:
            self._allocate(b, d, k, self.item(b, handles, k), table, oom)
        busy = b.gep(d, [I64(W["busy"])], source_etype=I64)
        took = b.extract_value(b.cmpxchg(busy, I64(0), I64(1), "acquire", "monotonic"), 1)
        fresh = self._scratch(b, d, table, took, busy, oom)
        release_gil = b.icmp_signed("!=", f("release_gil"), I64(0))
        state = self._alloca(b, PTR)
        b.store(NULL, state)
        with b.if_then(release_gil):
            b.store(b.call(self.mb.declare("PyEval_SaveThread", PTR, []), []), state)
        run = f("run", PTR)
        error_slot = f("error_slot")
        checked = b.icmp_signed(">=", error_slot, I64(0))
        with b.if_then(checked):
            b.store(NULL, self.item(b, table, error_slot))
        failed_slot = f("failed_slot")
        calls = b.icmp_signed(">=", failed_slot, I64(0))
        with b.if_then(calls):
            b.store(NULL, self.item(b, table, failed_slot))
        with b.if_then(b.icmp_unsigned("!=", run, NULL)):
            b.call(_Callee(run, ll.FunctionType(VOID, [PTR])), [table])
        with b.if_then(release_gil):
            b.call(self.mb.declare("PyEval_RestoreThread", VOID, [PTR]), [b.load(state, typ=PTR)])
        b.call(self.decref, [memo])
        with b.if_else(took) as (kept, other):
            with kept:
                b.atomic_rmw("xchg", busy, I64(0), "release")
            with other:
                b.call(self.mb.declare("free", VOID, [PTR]), [fresh])
        with b.if_then(calls):
            failed = b.load(self.item(b, table, failed_slot), typ=PTR)
            with b.if_then(b.icmp_unsigned("!=", failed, NULL)):
                self._free_outputs(b, d, handles)
                self._retry(b, d, args, nargs)
        with counted_loop(b, I64(0), n_out) as k:  # the outputs that ATen calls returned: theirs
            self._returned(b, d, k, self.item(b, handles, k), table, oom)
        bad_index = fn.append_basic_block("bad_index")
        done = fn.append_basic_block("done")
        word = self._alloca(b, I64)
        b.store(I64(0), word)
        with b.if_then(checked):
            b.store(b.ptrtoint(b.load(self.item(b, table, error_slot), typ=PTR), I64), word)
        flags = b.load(word, typ=I64)
        with b.if_then(b.icmp_unsigned("!=", b.and_(flags, I64(OUT_OF_MEMORY)), I64(0))):
            b.branch(oom)
        b.cbranch(b.icmp_unsigned("!=", flags, I64(0)), bad_index, done)
        b.position_at_end(done)
        self._results(b, d, handles)
        self._fail(b, fn, bad_index, handles, "index_error", INDEX_ERROR)
        self._fail(b, fn, oom, handles, "oom", OOM_ERROR)
        return fn

    def _fail(self, b: ll.IRBuilder, fn: ll.Function, block: ll.Block, handles: ll.Value, kind: str, text: str) -> None:
        """At `block`: free the outputs allocated so far (NULL handles are deleted as no-ops),
        raise the exception type in descriptor field `kind` with `text`, return NULL."""
        b.position_at_end(block)
        d = fn.args[0]
        self._free_outputs(b, d, handles)
        text_ptr = self.mb.cstring(f"braze_{kind}", text)
        b.call(self.mb.declare("PyErr_SetString", VOID, [PTR, PTR]), [self.field(b, d, kind, PTR), text_ptr])
        b.ret(NULL)

    def _memo(self, b: ll.IRBuilder, d: ll.Value, table: ll.Value, args: ll.Value, nargs: ll.Value) -> ll.Value:
        """A native body's memoized ATen results (runtime.Program._memo_function): their data
        pointers into the table; the tuple holding them is returned (a new reference, NULL if
        none), to be released after the run. Where the function raised, return NULL; where it
        returned other than one result per slot, the call runs in Python (`retry`)."""
        memo = self.field(b, d, "memo", PTR)
        held = self._alloca(b, PTR)
        b.store(NULL, held)
        with b.if_then(b.icmp_unsigned("!=", memo, NULL)):
            results = b.call(self.vectorcall, [memo, args, nargs, NULL])
            with b.if_then(b.icmp_unsigned("==", results, NULL)):
                b.ret(NULL)
            n = self.field(b, d, "n_memo")
            with b.if_then(b.icmp_signed("!=", b.call(self.mb.declare("PyTuple_Size", I64, [PTR]), [results]), n)):
                b.call(self.decref, [results])
                self._retry(b, d, args, nargs)
            b.store(results, held)
            item = self.mb.declare("PyTuple_GetItem", PTR, [PTR, I64])
            with counted_loop(b, I64(0), n) as k:
                tensor = b.gep(b.call(item, [results, k]), [I64(TENSOR_OFFSET)], source_etype=I8)
                slot = self.word(b, self.field(b, d, "memo_slots", PTR), k)
                b.call(self.data_ptr, [tensor, self.item(b, table, slot)])
        return b.load(held, typ=PTR)

    def _retry(self, b: ll.IRBuilder, d: ll.Value, args: ll.Value, nargs: ll.Value) -> None:
        """Return what the descriptor's `retry` (the program's Python body) gives for the call."""
        b.ret(b.call(self.vectorcall, [self.field(b, d, "retry", PTR), args, nargs, NULL]))

    def _free_outputs(self, b: ll.IRBuilder, d: ll.Value, handles: ll.Value) -> None:
        """Free the outputs allocated so far (NULL handles are deleted as no-ops)."""
        with counted_loop(b, I64(0), self.field(b, d, "n_outputs")) as k:
            b.call(self.delete, [b.load(self.item(b, handles, k), typ=PTR)])

    def _layout(self, b: ll.IRBuilder, o: Callable, table: ll.Value) -> dict[str, ll.Value]:
        """An output record's sizes and strides, resolved (a generic program's from its table)."""
        layout = {}
        for name in ("sizes", "strides"):
            words = o(name, PTR)
            with b.goto_entry_block():
                layout[name] = b.alloca(I64, size=I64(MAX_DIMS))
            with counted_loop(b, I64(0), o("ndim")) as i:
                value = self.resolve(b, table, self.word(b, words, i))
                b.store(value, b.gep(layout[name], [i], source_etype=I64))
        return layout

    def _returned(
        self, b: ll.IRBuilder, d: ll.Value, k: ll.Value, handle: ll.Value, table: ll.Value, oom: ll.Block
    ) -> None:
        """Output k, where an ATen call of the run returned it: that result, viewed with the
        output's layout (the same, or a view of all of it), its handle taken from the table."""
        o = self.record(b, d, "outputs", k, OUTPUT_WORDS)
        with b.if_then(b.icmp_signed(">=", o("handle"), I64(0))):
            held = self.item(b, table, o("handle"))
            result = b.load(held, typ=PTR)
            layout = self._layout(b, o, table)
            view = self.mb.declare("aoti_torch__reinterpret_tensor", I32, [PTR, I64, PTR, PTR, I64, PTR])
            err = b.call(view, [result, o("ndim"), layout["sizes"], layout["strides"], I64(0), handle])
            b.call(self.delete, [result])
            b.store(NULL, held)
            ok = b.append_basic_block("viewed")
            b.cbranch(b.icmp_signed("==", err, I32(0)), ok, oom)
            b.position_at_end(ok)

    def _allocate(
        self, b: ll.IRBuilder, d: ll.Value, k: ll.Value, handle: ll.Value, table: ll.Value, oom: ll.Block
    ) -> None:
        """Output k: a fresh tensor of its layout, from ATen's allocator (none where an ATen
        call of the run returns it)."""
        o = self.record(b, d, "outputs", k, OUTPUT_WORDS)
        with b.if_then(b.icmp_signed("<", o("handle"), I64(0))):
            layout = self._layout(b, o, table)
            empty = self.mb.declare("aoti_torch_empty_strided", I32, [I64, PTR, PTR, I32, I32, I32, PTR])
            cpu = I32(shim_constant("device_type_cpu"))
            dtype = b.trunc(o("dtype"), I32)
            err = b.call(empty, [o("ndim"), layout["sizes"], layout["strides"], dtype, cpu, I32(0), handle])
            ok = b.append_basic_block("allocated")
            b.cbranch(b.icmp_signed("==", err, I32(0)), ok, oom)
            b.position_at_end(ok)
            b.call(self.data_ptr, [b.load(handle, typ=PTR), self.item(b, table, o("slot"))])

    def _scratch(
        self, b: ll.IRBuilder, d: ll.Value, table: ll.Value, took: ll.Value, busy: ll.Value, oom: ll.Block
    ) -> ll.Value:
        """Point the table's scratch slots into the program's kept allocation (grown when this
        call needs more: a generic program's buffers follow its sizes) or, while another thread
        runs this program, into one fresh allocation, which is returned (else NULL)."""
        total = self._alloca(b, I64)
        b.store(I64(0), total)
        with counted_loop(b, I64(0), self.field(b, d, "n_scratch")) as k:
            s = self.record(b, d, "scratch", k, SCRATCH_WORDS)
            b.store(b.add(b.load(total, typ=I64), _aligned(b, self.resolve(b, table, s("bytes")))), total)
        need = b.load(total, typ=I64)
        kept = b.gep(d, [I64(W["kept"])], source_etype=I64)
        capacity = b.gep(d, [I64(W["capacity"])], source_etype=I64)
        alloc = self.mb.declare("aligned_alloc", PTR, [I64, I64])
        grow = b.and_(took, b.icmp_signed(">", need, b.load(capacity, typ=I64)))
        with b.if_then(grow):  # this thread holds the program: nobody else uses the memory
            b.call(self.mb.declare("free", VOID, [PTR]), [b.load(kept, typ=PTR)])
            b.store(I64(0), capacity)
            mem = self._kept_scratch(b, d, need)
            b.store(mem, kept)
            grown = b.append_basic_block("scratch_grown")
            failed = b.append_basic_block("scratch_failed")
            b.cbranch(b.icmp_unsigned("!=", mem, NULL), grown, failed)
            b.position_at_end(failed)
            b.atomic_rmw("xchg", busy, I64(0), "release")
            b.branch(oom)
            b.position_at_end(grown)
            b.store(need, capacity)
        fresh = self._alloca(b, PTR)
        b.store(NULL, fresh)
        with b.if_then(b.and_(b.not_(took), b.icmp_signed(">", need, I64(0)))):
            mem = b.call(alloc, [I64(64), need])
            ok = b.append_basic_block("scratch_allocated")
            b.cbranch(b.icmp_unsigned("!=", mem, NULL), ok, oom)
            b.position_at_end(ok)
            b.store(mem, fresh)
        base = b.select(took, b.load(kept, typ=PTR), b.load(fresh, typ=PTR))
        offset = self._alloca(b, I64)
        b.store(I64(0), offset)
        with counted_loop(b, I64(0), self.field(b, d, "n_scratch")) as k:
            s = self.record(b, d, "scratch", k, SCRATCH_WORDS)
            at = b.load(offset, typ=I64)
            b.store(b.gep(base, [at], source_etype=I8), self.item(b, table, s("slot")))
            b.store(b.add(at, _aligned(b, self.resolve(b, table, s("bytes")))), offset)
        return b.load(fresh, typ=PTR)

    def _kept_scratch(self, b: ll.IRBuilder, d: ll.Value, need: ll.Value) -> ll.Value:
        """A program's kept scratch memory of `need` bytes: on 2 MB pages from the descriptor's
        `huge` bytes up (a whole number of them, and madvise asks the kernel for huge pages;
        fewer TLB misses on the activations the kernels stream through), else 64-byte aligned."""
        huge = self.field(b, d, "huge")
        big = b.and_(b.icmp_signed(">", huge, I64(0)), b.icmp_signed(">=", need, huge))
        size = b.select(big, b.and_(b.add(need, I64(HUGE_PAGE - 1)), I64(-HUGE_PAGE)), need)
        alloc = self.mb.declare("aligned_alloc", PTR, [I64, I64])
        mem = b.call(alloc, [b.select(big, I64(HUGE_PAGE), I64(64)), size])
        with b.if_then(b.and_(big, b.icmp_unsigned("!=", mem, NULL))):  # (advice: its failure is harmless)
            b.call(self.mb.declare("madvise", I32, [PTR, I64, I32]), [mem, size, I32(MADV_HUGEPAGE)])
        return mem

    def _results(self, b: ll.IRBuilder, d: ll.Value, handles: ll.Value) -> None:
        """Wrap each output as a Python tensor; return it, or a tuple of them."""
        wrap = self.mb.declare(WRAP, PTR, [PTR])
        n = self.field(b, d, "n_outputs")

        def wrapped(k: ll.Value | int) -> ll.Value:
            h = b.load(self.item(b, handles, k), typ=PTR)
            obj = b.call(wrap, [h])
            b.call(self.delete, [h])  # moved from by the wrap: frees only the handle
            return obj

        with b.if_then(b.icmp_signed("==", self.field(b, d, "tuple_output"), I64(0))):
            b.ret(wrapped(0))
        tup = b.call(self.mb.declare("PyTuple_New", PTR, [I64]), [n])
        with counted_loop(b, I64(0), n) as k:
            b.call(self.mb.declare("PyTuple_SetItem", I32, [PTR, I64, PTR]), [tup, k, wrapped(k)])
        b.ret(tup)

    # --- helpers -----------------------------------------------------------------------------
    @staticmethod
    def _alloca(b: ll.IRBuilder, ty: ll.Type) -> ll.Value:
        with b.goto_entry_block():
            return b.alloca(ty)
