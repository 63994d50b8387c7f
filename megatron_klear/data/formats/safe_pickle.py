"""Decoding LiveCodeBench's ``private_test_cases``: base64 of zlib of a pickle of one JSON string.

A pickle is a program: loading one can import and call anything. The published files only ever
need a pickled ``str``, so :func:`loads_str` accepts exactly the opcodes that build one string
(checked with :mod:`pickletools` before anything is loaded, which executes nothing) and loads it
with an unpickler that refuses every global. A pickle that would import or call anything is
refused with :class:`UnsafePickle`, naming the opcode; nothing it names ever runs.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
import pickletools
import zlib

# Opcodes that push a str, frame the stream, memoize it, or end it: nothing that looks up a global,
# builds an object, or calls.
_ALLOWED = frozenset(
    {
        "PROTO",
        "FRAME",
        "STOP",
        "MEMOIZE",
        "PUT",
        "BINPUT",
        "LONG_BINPUT",
        "UNICODE",
        "BINUNICODE",
        "SHORT_BINUNICODE",
        "BINUNICODE8",
    }
)
MAX_DECOMPRESSED = 1 << 30


class UnsafePickle(ValueError):
    """The pickle holds something other than one plain string (or is not a pickle at all)."""


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module, name):  # never reached after the opcode check; a second wall
        raise UnsafePickle(f"the pickle names {module}.{name}: refused")

    def persistent_load(self, pid):
        raise UnsafePickle("the pickle uses persistent ids: refused")


def loads_str(data: bytes) -> str:
    """The one string a pickle holds; :class:`UnsafePickle` for anything else."""
    try:
        for op, _arg, pos in pickletools.genops(data):
            if op.name not in _ALLOWED:
                raise UnsafePickle(
                    f"opcode {op.name} at byte {pos}: only a plain string is accepted "
                    f"(this pickle would build or call something)"
                )
    except UnsafePickle:
        raise
    except Exception as e:  # noqa: BLE001 -- truncated or not a pickle: refused as unsafe
        raise UnsafePickle(f"not a readable pickle ({e})") from None
    value = _NoGlobals(io.BytesIO(data)).load()
    if not isinstance(value, str):
        raise UnsafePickle(f"expected a string, got {type(value).__name__}")
    return value


def decode_private_tests(text: str) -> str:
    """base64 -> zlib -> pickle -> the JSON text of the tests (not yet parsed)."""
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as e:
        raise UnsafePickle(f"neither JSON nor base64 ({e})") from None
    try:
        d = zlib.decompressobj()
        data = d.decompress(raw, MAX_DECOMPRESSED)
        if d.unconsumed_tail:
            raise UnsafePickle(f"decompresses to more than {MAX_DECOMPRESSED} bytes")
    except zlib.error as e:
        raise UnsafePickle(f"base64 but not zlib ({e})") from None
    return loads_str(data)
