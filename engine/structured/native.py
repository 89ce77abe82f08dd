"""llguidance's matchers through its C API, so that a native thread can fill their masks without the GIL.

The llguidance wheel exports its C API (``llg_*``, ``llguidance.h``) from the same library Python loaded; this module
binds it with ctypes. Why not the Python API: a Python ``LLMatcher`` can only be reached through Python, so a thread
that fills masks while the forward pass runs has to take the GIL to start and again to finish, two OS wake-ups a
step that on a 2-CPU host cost about what the fill they hide costs (docs/benchmarks.md §6). A matcher made here is a
plain pointer: ``llg_masks.c``'s worker fills a step's masks with no Python in the loop, and ctypes releases the GIL
around every call.

- :class:`NativeTokenizer`: llguidance's tokenizer from the model's ``tokenizer.json``, as the Python API builds it
  (same vocabulary size, EOS and default slices), plus the tokenize function the C API asks for: the model's own HF
  tokenizer, behind ``llg_masks.c``'s cache so that the worker thread rarely needs the GIL for it.
- :class:`NativeMatcher`: the calls the engine makes on a matcher (consume, stopped, error, copy), freed with its
  Python object.
- :class:`MaskFiller`: fills one step's masks into an int32 buffer, on the worker (``start`` / ``finish``) or inline.

The masks equal the Python API's bit for bit (``tests/test_structured_native.py`` walks both over every constraint
kind). Without a C compiler (or with ``TANDEM_NATIVE_KERNELS=0``) the matchers still work through ctypes: the
tokenizer calls Python directly and the masks are filled inline, one ctypes call per row.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import llguidance as llg

from native.build import BASE_FLAGS, compile_shared, compiler, enabled

log = logging.getLogger(__name__)

_P = ctypes.c_void_p
_TOKENIZE = ctypes.CFUNCTYPE(ctypes.c_size_t, _P, ctypes.POINTER(ctypes.c_uint8), ctypes.c_size_t,
                             ctypes.POINTER(ctypes.c_uint32), ctypes.c_size_t)
_INIT_BYTES = 512  # LlgConstraintInit is ~80 bytes; room for fields a later llguidance may append (zeroed, defaults)
_LOG_STDERR_OFFSET = 12  # LlgConstraintInit: tokenizer pointer, log_buffer_level (u32), log_stderr_level (u32), ...


class _TokenizerInit(ctypes.Structure):
    """``LlgTokenizerInit`` (llguidance.h)."""
    _fields_ = [("vocab_size", ctypes.c_uint32), ("tok_eos", ctypes.c_uint32), ("token_lens", _P),
                ("token_bytes", _P), ("tokenizer_json", ctypes.c_char_p), ("tokenize_assumes_string", ctypes.c_bool),
                ("tokenize_fn", _P), ("use_approximate_greedy_tokenize_fn", ctypes.c_bool),
                ("tokenize_user_data", _P), ("slices", _P)]


@functools.cache
def llg_lib() -> ctypes.CDLL:
    """llguidance's C API, from the library its Python package loaded (one copy of the code and its globals)."""
    lib = ctypes.CDLL(str(Path(llg.__file__).with_name("_lib.abi3.so")))
    i32, u32, size, b = ctypes.c_int32, ctypes.c_uint32, ctypes.c_size_t, ctypes.c_bool
    for name, args, res in (
            ("llg_new_tokenizer", [ctypes.POINTER(_TokenizerInit), ctypes.c_char_p, size], _P),
            ("llg_free_tokenizer", [_P], None),
            ("llg_constraint_init_set_defaults", [_P, _P], None),
            ("llg_new_matcher", [_P, ctypes.c_char_p, ctypes.c_char_p], _P),
            ("llg_clone_matcher", [_P], _P),
            ("llg_free_matcher", [_P], None),
            ("llg_matcher_get_error", [_P], ctypes.c_char_p),
            ("llg_matcher_is_error", [_P], b),
            ("llg_matcher_is_stopped", [_P], b),
            ("llg_matcher_is_accepting", [_P], b),
            ("llg_matcher_consume_token", [_P, u32], i32),
            ("llg_matcher_consume_tokens", [_P, ctypes.POINTER(u32), size], i32),
            ("llg_matcher_rollback", [_P, size], i32),
            ("llg_matcher_reset", [_P], i32),
            ("llg_matcher_get_mask_byte_size", [_P], size),
            ("llg_matcher_compute_mask_into", [_P, _P, size], i32)):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


@functools.cache
def masks_lib() -> ctypes.CDLL | None:
    """``llg_masks.c`` built for this host, or None (native code off, no compiler, or the build failed)."""
    cc = compiler()
    if not enabled() or cc is None:
        return None
    try:
        lib = ctypes.CDLL(str(compile_shared(cc, Path(__file__).with_name("llg_masks.c"),
                                             (*BASE_FLAGS, "-pthread"))))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("could not build the grammar-masks worker (%s); masks are filled inline", e)
        return None
    i64, u32 = ctypes.c_int64, ctypes.c_uint32
    for name, args, res in (
            ("tandem_masks_new", [_P], _P),
            ("tandem_masks_start", [_P, _P, i64, _P, i64, u32], None),
            ("tandem_masks_finish", [_P], i64),
            ("tandem_masks_fill", [_P, _P, i64, _P, i64, u32], i64),
            ("tandem_masks_free", [_P], None),
            ("tandem_tokcache_new", [_P, _P, i64], _P),
            ("tandem_tokcache_stats", [_P, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                                       ctypes.POINTER(ctypes.c_uint64)], None),
            ("tandem_tokcache_free", [_P], None)):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


def _address(fn: Any) -> int:
    return ctypes.cast(fn, _P).value or 0


class NativeTokenizer:
    """llguidance's tokenizer for one model. ``encode(text) -> ids`` is the model's tokenizer without special tokens
    (llguidance hands it valid UTF-8 only: ``tokenize_assumes_string``)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_id: int,
                 encode: Callable[[str], list[int]]) -> None:
        self._lib = llg_lib()
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._encode = encode
        self._callback = _TOKENIZE(self._tokenize)  # kept alive as long as the tokenizer
        masks = masks_lib()
        self._cache: int | None = None
        if masks is not None:
            self._cache = masks.tandem_tokcache_new(_address(self._callback), None, 12)
        fn, data = ((_address(masks.tandem_tokenize_cached), self._cache) if masks is not None and self._cache
                    else (_address(self._callback), None))
        init = _TokenizerInit(vocab_size=vocab_size, tok_eos=eos_token_id, tokenizer_json=tokenizer_json.encode(),
                              tokenize_assumes_string=True, tokenize_fn=fn, tokenize_user_data=data)
        err = ctypes.create_string_buffer(1024)
        ptr = self._lib.llg_new_tokenizer(ctypes.byref(init), err, len(err))
        if not ptr:
            self._free_cache()
            raise ValueError(f"llguidance refused the tokenizer: {err.value.decode(errors='replace')}")
        self.ptr: int = ptr
        self._init = (ctypes.c_uint8 * _INIT_BYTES)()
        self._lib.llg_constraint_init_set_defaults(self._init, ptr)
        ctypes.c_uint32.from_buffer(self._init, _LOG_STDERR_OFFSET).value = 0  # errors come back as values, not logs

    def _tokenize(self, _data: Any, data: Any, length: int, out: Any, cap: int) -> int:
        try:
            ids = self._encode(ctypes.string_at(data, length).decode("utf-8", "replace"))
        except Exception:  # never unwind through llguidance's Rust frames
            log.exception("tokenizer failed inside llguidance")
            return 0
        for i, t in enumerate(ids[:cap]):
            out[i] = t
        return len(ids)

    def cache_stats(self) -> dict[str, int]:
        masks = masks_lib()
        if masks is None or not self._cache:
            return {"hits": 0, "misses": 0, "entries": 0}
        h, m, e = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_uint64()
        masks.tandem_tokcache_stats(self._cache, ctypes.byref(h), ctypes.byref(m), ctypes.byref(e))
        return {"hits": h.value, "misses": m.value, "entries": e.value}

    def matcher(self, grammar: str) -> NativeMatcher:
        """A matcher for an llguidance grammar (``StructuredOutput.to_grammar``); check ``is_error()``."""
        ptr = self._lib.llg_new_matcher(self._init, b"llguidance", grammar.encode())
        if not ptr:
            raise MemoryError("llguidance could not allocate a matcher")
        return NativeMatcher(ptr, self)

    def _free_cache(self) -> None:
        masks = masks_lib()
        if masks is not None and self._cache:
            masks.tandem_tokcache_free(self._cache)
            self._cache = None

    def __del__(self) -> None:
        # Only once no matcher of it is left (each holds a reference to its tokenizer).
        if getattr(self, "ptr", None):
            self._lib.llg_free_tokenizer(self.ptr)
            self.ptr = 0
        self._free_cache()


class NativeMatcher:
    """One request's grammar state. Not thread-safe: one thread at a time, and none while a fill runs on it."""

    __slots__ = ("_lib", "ptr", "tokenizer")

    def __init__(self, ptr: int, tokenizer: NativeTokenizer) -> None:
        self.ptr = ptr
        self.tokenizer = tokenizer
        self._lib = tokenizer._lib

    def consume_token(self, token: int) -> bool:
        return self._lib.llg_matcher_consume_token(self.ptr, token) == 0

    def consume_tokens(self, tokens: Sequence[int]) -> bool:
        arr = (ctypes.c_uint32 * len(tokens))(*tokens)
        return self._lib.llg_matcher_consume_tokens(self.ptr, arr, len(tokens)) == 0

    def rollback(self, num_tokens: int) -> bool:
        return self._lib.llg_matcher_rollback(self.ptr, num_tokens) == 0

    def reset(self) -> bool:
        """Back to the grammar's start (False in the error state, which cannot be reset). What the matcher's lexer
        learnt (its lazily built automaton states) is kept: see :meth:`GrammarCompiler.recycle`."""
        return self._lib.llg_matcher_reset(self.ptr) == 0

    def is_stopped(self) -> bool:
        """The grammar is complete (only EOS may follow), or the matcher is in its error state."""
        return bool(self._lib.llg_matcher_is_stopped(self.ptr))

    def is_error(self) -> bool:
        return bool(self._lib.llg_matcher_is_error(self.ptr))

    def is_accepting(self) -> bool:
        return bool(self._lib.llg_matcher_is_accepting(self.ptr))

    def get_error(self) -> str:
        msg = self._lib.llg_matcher_get_error(self.ptr)
        return msg.decode(errors="replace") if msg else ""

    def deep_copy(self) -> NativeMatcher:
        return NativeMatcher(self._lib.llg_clone_matcher(self.ptr), self.tokenizer)

    def compute_mask_into(self, address: int, nbytes: int) -> bool:
        """This matcher's mask (one bit per token, ``nbytes`` long) written at ``address``; False in the error
        state (the buffer is then left as it was)."""
        return self._lib.llg_matcher_compute_mask_into(self.ptr, address, nbytes) == 0

    def __del__(self) -> None:
        if self.ptr:
            self._lib.llg_free_matcher(self.ptr)
            self.ptr = 0


class MaskFiller:
    """Fills a step's masks: ``start`` hands the rows to the native worker thread, ``finish`` takes what it has not
    begun and waits for the rest; ``fill`` does it all on the calling thread. One step at a time."""

    def __init__(self) -> None:
        self._masks = masks_lib()
        self._compute = _address(llg_lib().llg_matcher_compute_mask_into)
        self._worker: int | None = None
        self._job: tuple[Any, list[NativeMatcher]] | None = None  # the started step's pointer array and matchers

    @property
    def threaded(self) -> bool:
        """A native worker can fill while the caller runs (the C helper built)."""
        return self._masks is not None

    def start(self, matchers: Sequence[NativeMatcher], dest: int, words: int, eos: int) -> None:
        if self._masks is None:
            raise RuntimeError("no native masks worker on this host (see engine.structured.native.masks_lib)")
        self.finish()
        if self._worker is None:
            self._worker = self._masks.tandem_masks_new(self._compute)
            if not self._worker:
                raise MemoryError("could not start the grammar-masks thread")
        arr = (_P * len(matchers))(*(m.ptr for m in matchers))
        self._job = (arr, list(matchers))  # alive until finish: the worker reads both
        self._masks.tandem_masks_start(self._worker, arr, len(matchers), dest, words, eos)

    def finish(self) -> int:
        """Wait for the started step (if any); the number of its rows whose matcher was in its error state."""
        if self._job is None or self._worker is None or self._masks is None:
            return 0
        errors = int(self._masks.tandem_masks_finish(self._worker))
        self._job = None
        return errors

    def fill(self, matchers: Sequence[NativeMatcher], dest: int, words: int, eos: int) -> int:
        """All rows on the calling thread (GIL released); the number of rows in error."""
        if self._masks is not None:
            arr = (_P * len(matchers))(*(m.ptr for m in matchers))
            return int(self._masks.tandem_masks_fill(self._compute, arr, len(matchers), dest, words, eos))
        errors, row_bytes = 0, words * 4
        for j, m in enumerate(matchers):
            if not m.compute_mask_into(dest + j * row_bytes, row_bytes):
                errors += 1
                ctypes.memset(dest + j * row_bytes, 0, row_bytes)
                if eos // 32 < words:
                    ctypes.c_uint32.from_address(dest + j * row_bytes + (eos // 32) * 4).value = 1 << (eos % 32)
        return errors

    def close(self) -> None:
        self.finish()
        if self._worker is not None and self._masks is not None:
            self._masks.tandem_masks_free(self._worker)
            self._worker = None

    def __del__(self) -> None:
        self.close()
