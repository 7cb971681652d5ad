"""One publication's writes in one system call: Linux io_uring, driven through ctypes.

A fanout publication writes the same bytes to every subscriber that is in step
(server/realtime.py).  One `send()` per socket costs a system call and a trip
through Python's socket layer each; here the whole publication's sends are
queued in the ring's submission queue and handed to the kernel by one
`io_uring_enter`, which performs them inline (`MSG_DONTWAIT`: none of them ever
waits) and reports each one's result.  The GIL is released for that call, so the
database thread can commit the next batch meanwhile.  Hand-written rather than a
binding library: it needs one opcode, and the per-subscriber work is a strided
copy of file descriptors into the mapped submission entries (no Python object
per send).  bench/publish.py measures it against a bare `send()` loop.

Where io_uring is missing or refused (kernels before 5.6, `kernel.io_uring_disabled`,
a seccomp profile), `SendRing.open()` raises OSError and the caller keeps one
`send()` per socket.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import socket
import struct
from array import array
from typing import Protocol

# Syscall numbers from the generic table every Linux architecture shares since 5.1.
_NR_IO_URING_SETUP = 425
_NR_IO_URING_ENTER = 426
_OP_SEND = 26
_ENTER_GETEVENTS = 1
_FEAT_SINGLE_MMAP = 1
_OFF_SQ_RING, _OFF_CQ_RING, _OFF_SQES = 0, 0x8000000, 0x10000000
_SQE_BYTES, _CQE_BYTES = 64, 16
# io_uring_params: 10 u32 (entries, flags, features, ...), then io_sqring_offsets and
# io_cqring_offsets, each 8 u32 and a u64.
_PARAMS = struct.Struct("<10I8IQ8IQ")
_SEND_FLAGS = socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL
_U32 = 0xFFFFFFFF

log = logging.getLogger("scopewire.send_ring")

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


class SendRing:
    """Sends one buffer to many non-blocking stream sockets per call; one caller
    thread at a time (the event loop's)."""

    def __init__(self, fd: int, params: tuple[int, ...]) -> None:
        self._fd = fd
        entries, cq_entries, features = params[0], params[1], params[5]
        (_, sq_tail, sq_mask, _, _, _, sq_array, _, _,
         cq_head, cq_tail, cq_mask, _, _, cqes, _, _, _) = params[10:]
        sq_bytes = sq_array + entries * 4
        cq_bytes = cqes + cq_entries * _CQE_BYTES
        if features & _FEAT_SINGLE_MMAP:
            sq_bytes = cq_bytes = max(sq_bytes, cq_bytes)
        flags, prot = mmap.MAP_SHARED | mmap.MAP_POPULATE, mmap.PROT_READ | mmap.PROT_WRITE
        self._maps = [mmap.mmap(fd, sq_bytes, flags, prot, offset=_OFF_SQ_RING)]
        if not features & _FEAT_SINGLE_MMAP:
            self._maps.append(mmap.mmap(fd, cq_bytes, flags, prot, offset=_OFF_CQ_RING))
        self._maps.append(mmap.mmap(fd, entries * _SQE_BYTES, flags, prot, offset=_OFF_SQES))
        sq = memoryview(self._maps[0]).cast("I")
        cq = memoryview(self._maps[-2]).cast("I")
        self._sq, self._cq = sq, cq
        self.entries = entries
        self._sq_mask = sq[sq_mask // 4]
        self._cq_mask = cq[cq_mask // 4]
        self._sq_tail = sq_tail // 4
        self._cq_head, self._cq_tail = cq_head // 4, cq_tail // 4
        # Entry i of the submission queue is always entry i of the array of entries, and
        # every entry is a send whose user_data is its own index: per call only the file
        # descriptors, the buffer's address and its length are written.
        sq[sq_array // 4:sq_array // 4 + entries] = array("I", range(entries))
        sqes = self._maps[-1]
        self._sqe32 = memoryview(sqes).cast("I")
        self._sqe64 = memoryview(sqes).cast("Q")
        self._sqe32[0::16] = array("I", [_OP_SEND]) * entries
        self._sqe32[7::16] = array("I", [_SEND_FLAGS]) * entries
        self._sqe64[4::8] = array("Q", range(entries))
        cqe_region = memoryview(self._maps[-2])[cqes:cqes + cq_entries * _CQE_BYTES]
        self._cqe_res = cqe_region.cast("i")[2::4]
        self._cqe_data = cqe_region.cast("Q")[0::2]

    @classmethod
    def open(cls, entries: int = 1024) -> SendRing:
        """A ring of `entries` sends per call; OSError where io_uring cannot send."""
        params = ctypes.create_string_buffer(_PARAMS.size)
        fd = _syscall(ctypes.c_long(_NR_IO_URING_SETUP), ctypes.c_long(entries), params)
        if fd < 0:
            code = ctypes.get_errno()
            raise OSError(code, f"io_uring_setup: {os.strerror(code)}")
        try:
            ring = cls(fd, _PARAMS.unpack(params.raw))
            ring._check()
        except BaseException:
            os.close(fd)
            raise
        return ring

    def _check(self) -> None:
        """Real sends through a socket pair: the kernel may set up a ring and still
        not support sends in it, or a seccomp profile may refuse the call; and a
        send to a full socket must fail at once (-EAGAIN), not wait in the kernel
        for room — where it would, a stalled client would stall every publication."""
        left, right = socket.socketpair()
        try:
            left.setblocking(False)
            results = self.send([left.fileno()], b"ok")
            if results is not None or right.recv(2) != b"ok":
                raise OSError(errno.EOPNOTSUPP, f"io_uring send: {results}")
            with contextlib.suppress(BlockingIOError):
                while True:
                    left.send(bytes(65536))
            # Submitted without waiting for its completion, which must be there already.
            self._queue([left.fileno()], ctypes.cast(ctypes.c_char_p(b"x"), ctypes.c_void_p).value, 1)
            if self._enter(1, 0) != 1:
                raise OSError(ctypes.get_errno() or errno.EIO, "io_uring_enter refused a send")
            head = self._cq[self._cq_head]
            if self._cq[self._cq_tail] == head:
                right.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    while right.recv(1 << 20):  # the send waits for room: make it and let it finish
                        pass
                self._enter(0, 1)
                self._cq[self._cq_head] = (head + 1) & _U32
                raise OSError(errno.EOPNOTSUPP, "io_uring sends to a full socket wait instead of failing")
            result = self._cqe_res[head & self._cq_mask]
            self._cq[self._cq_head] = (head + 1) & _U32
            if result != -errno.EAGAIN:
                raise OSError(errno.EOPNOTSUPP, f"io_uring send to a full socket: {result}")
        finally:
            left.close()
            right.close()

    def close(self) -> None:
        for view in (self._sq, self._cq, self._sqe32, self._sqe64, self._cqe_res, self._cqe_data):
            view.release()
        for region in self._maps:
            region.close()
        os.close(self._fd)

    def send(self, fds: list[int], data: bytes) -> list[int] | None:
        """Send `data` once to each socket in `fds`, without waiting for any: None
        when every one took all of it, else each one's result in order — bytes
        taken (a short count: its buffer filled up) or -errno (-EAGAIN: it took
        nothing).  RingBroken if the kernel did not take every send."""
        size = len(data)
        address = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value
        chunks: list[tuple[int, list[int | None] | None]] = []  # (sends, their results; None: all full)

        def joined() -> list[int | None]:
            return [result for count, got in chunks for result in (got or [size] * count)]

        for start in range(0, len(fds), self.entries):
            chunk = fds[start:start + self.entries]
            try:
                chunks.append((len(chunk), self._send_chunk(chunk, address, size)))
            except RingBroken as broken:
                done = joined() + broken.results
                broken.results = done + [None] * (len(fds) - len(done))
                raise
        return None if all(got is None for _, got in chunks) else joined()

    def _send_chunk(self, fds: list[int], address: int, size: int) -> list[int] | None:
        count, mask = len(fds), self._sq_mask
        first = self._queue(fds, address, size)
        submitted = max(self._enter(count, count), 0)
        cq = self._cq
        head = cq[self._cq_head]
        completed = (cq[self._cq_tail] - head) & _U32
        while completed < submitted:
            # Inline sends complete before the call returns; a signal may end the wait early.
            if self._enter(0, submitted - completed) < 0 and ctypes.get_errno() != errno.EINTR:
                break
            completed = (cq[self._cq_tail] - head) & _U32
        completed = min(completed, submitted)
        slot = head & self._cq_mask
        stretches = [(slot, min(completed, self._cq_mask + 1 - slot))]
        if stretches[0][1] < completed:
            stretches.append((0, completed - stretches[0][1]))
        taken = [self._cqe_res[at:at + n].tolist() for at, n in stretches]
        results = None
        if completed != count or sum(part.count(size) for part in taken) != count:
            # The queue's first `submitted` entries went to the kernel: without a completion
            # a send's outcome is unknown, and its connection is dropped (-EIO; the client
            # resumes from its cursors).  The rest were never sent (None).
            results = [-errno.EIO] * submitted + [None] * (count - submitted)
            for (at, n), part in zip(stretches, taken):
                for index, result in zip(self._cqe_data[at:at + n].tolist(), part):
                    results[(index - first) & mask] = result
        cq[self._cq_head] = (head + completed) & _U32
        if completed != count:
            # Never seen with sockets that are not waited on.  The queue would still hold
            # the entries not taken, and a later call would send them again: the ring is done.
            raise RingBroken(f"io_uring took {submitted} of {count} sends, completed {completed}", results)
        return results

    def _queue(self, fds: list[int], address: int, size: int) -> int:
        """Queue sends of `size` bytes at `address` to `fds` (not yet submitted): the
        queue position of the first."""
        tail = self._sq[self._sq_tail]
        first = tail & self._sq_mask
        # The queue's positions wrap: at most two contiguous stretches of entries.
        for at, part in ((first, fds[:self.entries - first]), (0, fds[self.entries - first:])):
            if part:
                end = (at + len(part)) * 16
                self._sqe32[at * 16 + 1:end:16] = array("I", part)
                self._sqe64[at * 8 + 2:end // 2:8] = array("Q", [address]) * len(part)
                self._sqe32[at * 16 + 6:end:16] = array("I", [size]) * len(part)
        self._sq[self._sq_tail] = (tail + len(fds)) & _U32
        return first

    def _enter(self, submit: int, wait: int) -> int:
        return _syscall(ctypes.c_long(_NR_IO_URING_ENTER), ctypes.c_long(self._fd), ctypes.c_long(submit),
                        ctypes.c_long(wait), ctypes.c_long(_ENTER_GETEVENTS), None, ctypes.c_long(0))


class RingBroken(Exception):
    """The kernel did not take or complete every send: `results` as SendRing.send's,
    None for a send that did not happen."""

    def __init__(self, message: str, results: list[int | None]) -> None:
        super().__init__(message)
        self.results = results


class BatchedSink(Protocol):
    def send_now(self, frames: bytes) -> None:
        """Write the frames with a `send()` of its own (and cut off what cannot keep up)."""

    def sent(self, frames: bytes, result: int) -> None:
        """What the ring's send of the frames did: bytes taken, or -errno."""


class PublicationWrites:
    """The writes of one fanout publication, gathered by their bytes (every subscriber
    in step gets the same ones) and sent when the publication is over: through the
    ring where there is one, else one `send()` each.  Nothing else writes to these
    sockets in between: the publication never yields."""

    __slots__ = ("_ring", "_groups")

    def __init__(self, ring: SendRing) -> None:
        self._ring: SendRing | None = ring
        self._groups: dict[bytes, tuple[list[int], list[BatchedSink]]] = {}

    def add(self, fd: int, sink: BatchedSink, frames: bytes) -> None:
        group = self._groups.get(frames)
        if group is None:
            group = self._groups[frames] = ([], [])
        group[0].append(fd)
        group[1].append(sink)

    def add_many(self, fds: list[int], sinks: list[BatchedSink], frames: bytes) -> None:
        """`add` for each of `fds` and its sink (copied: the caller's lists may change
        while the results are handled)."""
        group = self._groups.get(frames)
        if group is None:
            self._groups[frames] = (fds.copy(), sinks.copy())
        else:
            group[0].extend(fds)
            group[1].extend(sinks)

    def flush(self) -> None:
        if not self._groups:
            return
        groups, self._groups = self._groups, {}
        for frames, (fds, sinks) in groups.items():
            ring = self._ring
            if ring is None:
                for sink in sinks:
                    sink.send_now(frames)
                continue
            try:
                results = ring.send(fds, frames)
            except RingBroken as broken:
                log.error("io_uring sends failed; fanout writes use send() from now on",
                          extra={"why": str(broken)})
                self._ring = None
                ring.close()
                results = broken.results
            if results is None:
                continue
            size = len(frames)
            for sink, result in zip(sinks, results):
                if result is None:
                    sink.send_now(frames)
                elif result != size:
                    sink.sent(frames, result)

    def close(self) -> None:
        if self._ring is not None:
            self._ring.close()
            self._ring = None
