"""bench/fanout.py's subscriber process counts and times every delivery once: frames split
across reads, warm-up deliveries apart from the measured ones, those received after the window
apart from those in it, and the replies and pings between them still answered."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.common import RECV_BYTES
from bench.fanout import make_content, server_frame

ROOT = Path(__file__).resolve().parents[1]


def _event(ts_ns: int, seq: int, size: int = 200) -> bytes:
    return server_frame(json.dumps({"type": "event", "event": "message.created", "seq": seq,
                                    "data": {"content": make_content(ts_ns, size)}}).encode())


def _read_frame(sock: socket.socket) -> dict:
    head = sock.recv(2, socket.MSG_WAITALL)
    length = head[1] & 0x7F
    if length == 126:
        length = int.from_bytes(sock.recv(2, socket.MSG_WAITALL), "big")
    sock.recv(4, socket.MSG_WAITALL)  # the client's mask key: zero
    return json.loads(sock.recv(length, socket.MSG_WAITALL))


def _serve(listener: socket.socket, script: list[bytes], ready: threading.Event, pong: list[bytes]) -> None:
    sock, _ = listener.accept()
    with sock:
        request = b""
        while b"\r\n\r\n" not in request:
            request += sock.recv(4096)
        sock.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
        assert _read_frame(sock)["op"] == "auth"
        sock.sendall(server_frame(b'{"type": "result", "id": "a"}'))
        assert _read_frame(sock)["op"] == "subscribe"
        sock.sendall(server_frame(b'{"type": "result", "id": "s"}'))
        ready.wait(30)
        for piece in script:
            sock.sendall(piece)
        head = sock.recv(2, socket.MSG_WAITALL)
        pong.append(sock.recv(4 + (head[1] & 0x7F), socket.MSG_WAITALL)[4:])


def _line(process: subprocess.Popen, phase: str) -> dict:
    while True:
        line = json.loads(process.stdout.readline())
        if line.get("phase") == phase:
            return line


def test_every_delivery_is_counted_once_and_timed_from_its_read():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    t0 = time.time_ns()
    warm = _event(t0 - 5_000_000_000, 1)
    measured = [_event(t0 + i * 1_000_000, 2 + i, 200 if i != 2 else 2 * RECV_BYTES) for i in range(5)]
    # The third measured event is larger than a read: its timestamp comes in one read, its end in the next.
    script = [warm + measured[0] + server_frame(b'{"type": "other"}') + measured[1] + measured[2] + measured[3],
              measured[4] + server_frame(b"p!", opcode=0x9)]  # the pong: all of it was read
    ready, pong = threading.Event(), []
    server = threading.Thread(target=_serve, args=(listener, script, ready, pong), daemon=True)
    server.start()
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.fanout", "--role", "subscribers", "--url", f"ws://127.0.0.1:{port}/",
         "--count", "1", "--keys", "k", "--scope-id", "s", "--max-seconds", "60"],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        _line(process, "authed")
        window_end = time.time_ns()  # before anything measured is sent: none of it is in the window
        # Lines are read in order: once it reports `subscribed`, it has taken in the window too.
        process.stdin.write(f"measure {t0} {window_end}\nsubscribe\n")
        process.stdin.flush()
        _line(process, "subscribed")
        ready.set()
        server.join(30)
        process.stdin.write("report\n")
        process.stdin.flush()
        report = _line(process, "report")
    finally:
        process.kill()
        process.wait()
        listener.close()
    assert pong == [b"p!"]
    assert (report["measured"], report["warmup_deliveries"]) == (5, 1)
    assert report["counts"]["other_frames"] == 1
    assert report["in_window"] == 0
    assert sum(report["hist"].values()) == 5
    assert t0 < report["first_ns"] < report["last_ns"]
    assert report["measured_bytes"] >= 2 * RECV_BYTES
