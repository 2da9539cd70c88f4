"""Follow the writer: publish a staged file while the original writer is still writing it.

A staged save costs serialize + copy when they run one after the other. With ``follow``,
the copy to the destination starts with the save and reads only bytes the writer has
already written, so a big file costs about the slower of the two (issue 13).

How far the writer got: not the file's size (safetensors 0.8 preallocates the whole file
with set_len/ftruncate before writing), but the file position of the writer's own
descriptor, read from /proc/self/fdinfo/<fd> (``pos:``). write(2) copies its bytes into the
page cache before it advances the position (the position is updated when the call
returns), so every byte below a position we read is in the page cache, where a second
descriptor on the same inode reads it. The writer's descriptor is the one open descriptor
of this process whose link points into the save's private (0700) staging directory: no other
process can open anything there, and we exclude our own descriptors. Its inode is checked in
the same fdinfo read (``ino:``), so a descriptor number the writer closed and the process
reused for something else is never taken for the writer. safetensors 0.8 writes a sibling
``.tmpXXXXXX`` and renames it: we hold the inode, not the name, so the rename does not matter.

What that argument assumes (a writer that only appends with write(2), never pwrite/mmap,
never seeks back to rewrite) is checked, not trusted: once the writer has returned, the
staged file is read back from the staging root (page cache: cheap) and the CRC-32 of every
byte the copy read while the writer was still writing is compared with the CRC-32 of the
same range read back, before the destination is fsync'ed, closed or renamed. (Bytes the copy
read after the writer had returned are the final bytes by definition: the reader checks the
writer's state before each read.) The read-back runs in the saving thread, which is idle
while the copy finishes.
Any difference, or a final file that is not the inode we followed, aborts this copy (our temp
is removed) and the complete staged file is published again from scratch.

Only ``replace`` saves are followed, into our own hidden temp created with O_EXCL: a
mismatch, a failing writer or a kill costs that temp and nothing else, and the final name
is touched only by the rename of a checked file. A ``direct`` save is never followed: it
writes the final name only once the writer has finished (_publish).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import zlib
from pathlib import Path
from typing import Optional

log = logging.getLogger("safestage")

# How often the follower looks at the writer's position while it waits for bytes (seconds).
# safetensors writes one tensor per write(2): positions advance in steps of a tensor.
POLL_SECONDS = 0.002
# Below this size a save is not followed (_stage.follow_strategy). Following a 1 KiB save
# cost 2-8.5 ms more than a plain replace (the copying thread, its polling, the read-back;
# benchmarks/results/2026-12-01-follow.md, three runs: 2.9/10.0/7.4 ms against 1.0/1.5/1.6),
# while the most overlapping can win back is the serialize time, about 40 ms for 64 MiB
# here (0.64 s per GiB into /dev/shm).
FOLLOW_MIN_BYTES = 64 << 20
_VERIFY_CHUNK = 4 << 20


class WriterFailed(Exception):
    """Internal: the writer raised; the follow copy is abandoned (its target removed)."""


class FollowMismatch(Exception):
    """Internal: the bytes copied while following are not the staged file's bytes (or the
    writer's file could not be followed to its end): the staged file is copied again."""


class Follower:
    """Shared by the writer's thread (``finish``/``fail``) and the publishing thread
    (``open``, then the reader's ``readinto`` as ``copy_to_new_file`` calls it)."""

    def __init__(self, private_dir: Path, staged: Path, *, poll: float = POLL_SECONDS) -> None:
        self.private_dir = private_dir
        self.staged = staged
        self.poll = poll
        self._prefix = str(private_dir) + "/"
        self._changed = threading.Condition()
        self._state = "writing"  # writing -> done | failed
        self._opens = 0
        self._attached = False  # a reader holds the writer's inode (decided under the lock)
        # Bytes [0, _while_writing) were copied while the writer was writing: only those need
        # the read-back check (the rest were read after it returned: the final bytes).
        self._while_writing: Optional[int] = None
        self._reader_gone = False
        self._final: Optional[tuple[int, int]] = None  # (CRC-32, length) of that prefix, read back
        self._final_error: Optional[str] = None
        self.followed = False  # whether a copy read bytes while the writer was writing
        self.bytes_while_writing = 0  # how many (for the log and the tests)

    # -- the writer's side --------------------------------------------------------------------
    def finish(self) -> None:
        with self._changed:
            self._state = "done"
            self._changed.notify_all()

    def fail(self) -> None:
        """The writer raised, or the save is interrupted (even after ``finish``): the reader
        raises WriterFailed at its next step and the copy is abandoned."""
        with self._changed:
            self._state = "failed"
            self._changed.notify_all()

    def check_final(self) -> None:
        """Called by the writer's thread once it returned (and after ``finish``): read back
        the part of the staged file the reader copied while the writer was writing, and
        publish its CRC-32 for the reader's final comparison. It runs while the publisher
        copies the tail, so a copy slower than the writer hides it. Skipped when no reader
        followed the writer (the copy then reads the finished file), and when the publisher
        is gone (it failed: its copy is abandoned anyway)."""
        with self._changed:
            while (
                self._attached
                and self._while_writing is None
                and not self._reader_gone
                and self._state == "done"
            ):
                self._changed.wait()
            if self._while_writing is None:
                return
            length = self._while_writing
        try:
            result: Optional[tuple[int, int]] = _crc_of(self.staged, length)
            error = None
        except OSError as exc:
            result, error = None, f"{self.staged} could not be read back: {exc}"
        with self._changed:
            self._final, self._final_error = result, error
            self._changed.notify_all()

    def copied_while_writing(self, length: int) -> None:
        """The reader saw the writer's return: what it copied before that is ``length`` bytes."""
        with self._changed:
            self._while_writing = length
            self._changed.notify_all()

    def reader_gone(self) -> None:
        """The publishing thread ends (or never got to read): nobody needs a read-back."""
        with self._changed:
            self._reader_gone = True
            self._changed.notify_all()

    def attach_allowed(self) -> bool:
        """Under the lock: a reader may follow only while the writer is still writing (the
        writer's thread then reads the file back when it returns, see check_final)."""
        with self._changed:
            if self._state != "writing":
                return False
            self._attached = True
            return True

    def final_crc(self) -> tuple[int, int]:
        """Wait for check_final's (CRC-32, length) of the prefix, read back."""
        with self._changed:
            while self._final is None and self._final_error is None:
                if self._state == "failed":
                    raise WriterFailed(str(self.staged))
                self._changed.wait()
            if self._final is None:
                raise FollowMismatch(self._final_error or "no read-back")
            return self._final

    # -- the publisher's side -----------------------------------------------------------------
    def state(self) -> str:
        with self._changed:
            return self._state

    def wait(self, timeout: Optional[float] = None) -> str:
        with self._changed:
            if self._state == "writing":
                self._changed.wait(timeout)
            return self._state

    def written(self) -> None:
        """Wait for the writer to return; WriterFailed if it failed (or the save is abandoned)."""
        while (state := self.wait()) == "writing":
            pass
        if state == "failed":
            raise WriterFailed(str(self.staged))

    def open(self) -> Reader:
        """A reader for one copy attempt. The first follows the writer; a second (a copy
        attempt retried under a fresh temp name) waits for the writer and reads the finished
        staged file like a plain publish."""
        self._opens += 1
        if self._opens == 1:
            return _FollowReader(self)
        self.written()
        return _PlainReader(self.staged)


class Reader:
    """What copy_to_new_file reads from: ``readinto`` until 0, then ``expected`` is the size
    the target must have."""

    expected: int = -1

    def readinto(self, buffer: bytearray) -> int:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class _PlainReader(Reader):
    def __init__(self, path: Path) -> None:
        self._file = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by close()
        self.expected = os.fstat(self._file.fileno()).st_size

    def readinto(self, buffer: bytearray) -> int:
        return self._file.readinto(buffer) or 0

    def close(self) -> None:
        self._file.close()


class _FollowReader(Reader):
    def __init__(self, follower: Follower) -> None:
        self._f = follower
        self._fd: Optional[int] = None  # our own read descriptor on the writer's inode
        self._writer_fd = -1
        self._ino = -1
        self._dev = -1
        self._mnt = -1
        self._copied = 0
        self._crc = 0  # of the bytes copied while the writer was writing
        self._while_writing: Optional[int] = None
        self._final: Optional[int] = None  # the staged file's size once the writer returned
        self._plain: Optional[_PlainReader] = None  # the writer was never found

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
        if self._plain is not None:
            self._plain.close()
        self._f.reader_gone()

    def readinto(self, buffer: bytearray) -> int:
        if self._plain is not None:
            return self._plain.readinto(buffer)
        while True:
            state = self._f.state()
            if state == "failed":
                raise WriterFailed(str(self._f.staged))
            if self._fd is None:
                if state == "done":
                    # Never saw the writer (safetensors 0.7 writes the whole file in one call,
                    # or a writer we cannot see): a plain copy of the finished file.
                    log.debug("follow: writer of %s not seen; plain copy", self._f.staged)
                    self._plain = _PlainReader(self._f.staged)
                    self.expected = self._plain.expected
                    return self._plain.readinto(buffer)
                if not self._attach():
                    self._f.wait(self._f.poll)
                    continue
            if state == "done":
                if self._while_writing is None:  # from here on every read is of final bytes
                    self._while_writing = self._copied
                    self._f.copied_while_writing(self._copied)
                return self._read_tail(buffer)
            limit = self._writer_position()
            if limit > self._copied:
                count = self._read(buffer, limit)
                self._f.followed = True
                self._f.bytes_while_writing += count
                return count
            self._f.wait(self._f.poll)

    def _read(self, buffer: bytearray, limit: int) -> int:
        assert self._fd is not None
        want = min(len(buffer), limit - self._copied)
        data = memoryview(buffer)[:want]
        count = os.preadv(self._fd, [data], self._copied)
        if count <= 0:  # the inode is shorter than the writer's position: cannot be
            raise FollowMismatch(f"{self._f.staged}: short read at {self._copied}")
        if self._while_writing is None:
            self._crc = zlib.crc32(data[:count], self._crc)
        self._copied += count
        return count

    def _read_tail(self, buffer: bytearray) -> int:
        """The writer has returned: copy what is left of the file we followed, then check
        that it is the staged file and that its bytes are the ones we copied."""
        assert self._fd is not None
        if self._final is None:
            try:
                staged = os.stat(self._f.staged)
            except OSError as exc:
                raise FollowMismatch(f"{self._f.staged}: {exc}") from exc
            if (staged.st_dev, staged.st_ino) != (self._dev, self._ino):
                raise FollowMismatch(f"{self._f.staged} is not the file the writer wrote into")
            self._final = os.fstat(self._fd).st_size
        if self._copied < self._final:
            return self._read(buffer, self._final)
        if self._copied > self._final:
            raise FollowMismatch(f"{self._f.staged} shrank to {self._final} bytes after {self._copied} were copied")
        self._verify()
        self.expected = self._final
        return 0

    def _verify(self) -> None:
        crc, nbytes = self._f.final_crc()
        if (crc, nbytes) != (self._crc, self._while_writing):
            raise FollowMismatch(
                f"{self._f.staged}: CRC-32 {crc:08x} of its first {nbytes} bytes read back, "
                f"{self._crc:08x} of the {self._while_writing} bytes copied while following"
            )

    # -- finding and watching the writer ------------------------------------------------------
    def _attach(self) -> bool:
        """Find the one writable descriptor of this process on a file in the private
        directory, and open the same inode for reading."""
        found = []
        try:
            entries = os.listdir("/proc/self/fd")
        except OSError:
            return False
        for name in entries:
            try:
                target = os.readlink(f"/proc/self/fd/{name}")
            except OSError:
                continue
            if target.startswith(self._f.private_dir.as_posix() + "/"):
                found.append(int(name))
        if len(found) != 1:
            return False  # none yet, or several (not the one-file writer this is for)
        fd = found[0]
        info = _fdinfo(fd)
        if info is None or not info["flags"] & (os.O_WRONLY | os.O_RDWR):
            return False
        try:
            mine = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.EACCES):
                log.debug("follow: cannot open the writer's fd %d: %s", fd, exc)
            return False
        st = os.fstat(mine)
        if st.st_ino != info["ino"] or not str(os.readlink(f"/proc/self/fd/{mine}")).startswith(
            self._f.private_dir.as_posix() + "/"
        ):
            os.close(mine)  # the number was reused between the scan and the open
            return False
        if not self._f.attach_allowed():
            os.close(mine)  # the writer returned meanwhile: a plain copy of the finished file
            return False
        self._fd, self._writer_fd, self._ino, self._dev = mine, fd, st.st_ino, st.st_dev
        self._mnt = info["mnt_id"]
        log.debug("follow: following fd %d (inode %d) of %s", fd, st.st_ino, self._f.staged)
        return True

    def _writer_position(self) -> int:
        """Bytes the writer has surely written: its descriptor's position, read together with
        the inode in one read of fdinfo; 0 more when the descriptor is gone or reused."""
        info = _fdinfo(self._writer_fd)
        if info is None or (info["ino"], info["mnt_id"]) != (self._ino, self._mnt):
            return self._copied  # closed (the writer is returning) or reused: wait for done
        return info["pos"]


def _fdinfo(fd: int) -> Optional[dict[str, int]]:
    """pos, flags (octal in the file), mnt_id and ino of one of our descriptors; None if it is
    closed or the kernel does not report the inode (older kernels): then we do not follow."""
    try:
        with open(f"/proc/self/fdinfo/{fd}", "rb", buffering=0) as handle:
            text = handle.read(4096)
    except OSError:
        return None
    fields: dict[str, int] = {}
    for line in text.split(b"\n"):
        key, _, value = line.partition(b":")
        if key in (b"pos", b"ino", b"mnt_id"):
            fields[key.decode()] = int(value)
        elif key == b"flags":
            fields["flags"] = int(value, 8)
    if len(fields) != 4:
        return None
    return fields


def _crc_of(path: Path, length: int) -> tuple[int, int]:
    """(CRC-32, bytes read) of the first ``length`` bytes of a file, read in chunks (zlib
    releases the GIL on large buffers)."""
    crc = 0
    nbytes = 0
    with open(path, "rb", buffering=0) as handle:
        buffer = bytearray(_VERIFY_CHUNK)
        view = memoryview(buffer)
        while nbytes < length:
            count = handle.readinto(view[: min(_VERIFY_CHUNK, length - nbytes)]) or 0
            if not count:
                break
            crc = zlib.crc32(view[:count], crc)
            nbytes += count
    return crc, nbytes
