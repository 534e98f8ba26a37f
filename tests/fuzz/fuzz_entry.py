"""atheris harness: arbitrary bytes as an entry file, a bundle, or a store index.

    python tests/fuzz/fuzz_entry.py -runs=100000 [-max_total_time=600]

Each input must end in a typed promptstore error or a clean miss: any other exception, a
crash or a hang is a finding.
"""

import os
import sys
import tempfile

import atheris

with atheris.instrument_imports():
    from promptstore import PromptStore
    from promptstore._codec import decode
    from promptstore.errors import BundleError, CorruptEntryError, EntryVersionError, FormatVersionError

WORK = tempfile.mkdtemp(prefix="ps-fuzz-")
STORE = PromptStore(os.path.join(WORK, "store"), memory_bytes=0, disk_bytes="64MiB")
BUNDLE = os.path.join(WORK, "b.psb")


def one_input(data: bytes) -> None:
    mode = data[:1]
    body = data[1:]
    if mode == b"b":
        with open(BUNDLE, "wb") as f:
            f.write(body)
        try:
            STORE.import_bundle(BUNDLE)
        except (BundleError, FormatVersionError):
            pass
    else:
        try:
            decode(body)
        except (CorruptEntryError, EntryVersionError):
            pass


if __name__ == "__main__":
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
