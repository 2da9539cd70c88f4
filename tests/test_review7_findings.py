"""A direct save whose destination fails says what happened (found against followed direct
saves, which are gone: a direct save publishes after its writer)."""

from __future__ import annotations

import os

import pytest

CHUNK = 1 << 20
CHUNKS = 12


def _slow_writer(delay: float = 0.03):
    """Like safetensors 0.8: a sibling .tmpXXXXXX preallocated, one write per 1 MiB chunk,
    renamed at the end (the staged name exists only once the writer is done)."""
    import time

    def write(path: str) -> None:
        target = os.path.join(os.path.dirname(path), ".tmpAbC123")
        fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, CHUNK * CHUNKS)
            for index in range(CHUNKS):
                time.sleep(delay)
                os.write(fd, bytes([index + 1]) * CHUNK)
        finally:
            os.close(fd)
        os.replace(target, path)

    return write


def test_direct_destination_full_error_says_what_happened(small_tmpfs, shm_root):
    """A ``direct`` save (follow asked for) of a new 12 MiB file onto a 2 MiB filesystem:
    the copy fails (real ENOSPC) and the complete staged copy is kept. The PublishError says
    what every other PublishError says: the destination and step, what to do, that nothing
    torn is left under the final name, and where the complete copy is kept."""
    import safestage

    dest = small_tmpfs / "model.safetensors"
    with (
        safestage._api.force_follow(safestage.staged(shm_root, publish="direct")) as stage,
        pytest.raises(safestage.PublishError) as info,
    ):
        stage._save(_slow_writer(), dest)
    error = info.value
    assert error.errno == 28, error  # the fault fired: a real ENOSPC from the destination
    assert error.staged_path is not None and os.path.exists(error.staged_path)
    assert os.listdir(small_tmpfs) == []
    text = str(error)
    assert str(dest) in text and error.staged_path in text and "direct" in text, (
        f"the PublishError reads only {text!r}: no destination, no step, no advice, no word "
        f"of what is under {dest}, and not where the complete copy ({error.staged_path}) is kept"
    )


