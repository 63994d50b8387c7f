"""``torchrun ... tests/distributed/enospc_sft.py <overrides>``: the SFT entry point with a disk that
fills up during the save of step ``KLEAR_TEST_ENOSPC_STEP`` (a simulated ENOSPC: each tensor file of
that checkpoint gets a partial write, then "No space left on device", in Megatron's writer process).
Used by tests/distributed/test_bad_lines_and_foreign_runs.py."""

import errno
import functools
import os
import sys

from megatron.core.dist_checkpointing.strategies import filesystem_async

FULL_AT = f".tmp-iter_{int(os.environ['KLEAR_TEST_ENOSPC_STEP']):07d}"
_write_item = filesystem_async._write_item


@functools.wraps(_write_item)
def _full_disk(*args, **kwargs):
    stream = next(a for a in args if hasattr(a, "write") and hasattr(a, "name"))
    if FULL_AT in str(stream.name):
        stream.write(b"\0" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), stream.name)
    return _write_item(*args, **kwargs)


filesystem_async._write_item = _full_disk

if __name__ == "__main__":
    from megatron_klear.__main__ import main

    sys.exit(main(["sft", *sys.argv[1:]]))
