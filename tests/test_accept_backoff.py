"""A server out of file descriptors backs off in its accept loop and says so
once, not at every retry; when descriptors are free again it serves."""

from __future__ import annotations

import json
import resource
import signal

import trio
from wsproto.events import AcceptConnection, Message

from tests.test_shutdown import key_dir, serve_on  # noqa: F401 - key_dir is a fixture
from tests.test_transport import RawClient

DESCRIPTORS = 256


def _few_descriptors() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (DESCRIPTORS, DESCRIPTORS))


async def test_running_out_of_descriptors_backs_off_quietly_and_recovers(database_dsn, key_dir):  # noqa: F811
    caps = str(10 * DESCRIPTORS)  # the admission caps would refuse first: lift them past the descriptor limit
    process, port = await serve_on(database_dsn, key_dir, "--max-connections", caps, "--max-unauthenticated", caps,
                                   "--max-unauthenticated-per-address", caps, preexec_fn=_few_descriptors)
    try:
        # More connections than the server has descriptors: the rest wait in the listen backlog.
        flood = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(DESCRIPTORS + 50)]
        await trio.sleep(3)  # deliberate: let the accept loop hit EMFILE and retry for a while
        log = (key_dir / "stderr").read_text().splitlines()
        failures = [line for line in log if "accept failed" in line]
        assert len(failures) == 1, failures
        # The operator was told at start that the cap cannot protect this server.
        assert any("above what the descriptor limit allows" in line for line in log)
        for stream in flood:
            await stream.aclose()
        client, accepted = await RawClient.open_port(port)
        assert isinstance(accepted, AcceptConnection)
        await client.send(Message(data=json.dumps({"op": "ping", "id": "p"})))
        assert (await client.next_message())["id"] == "p"
        await client.stream.aclose()
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(30):
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
