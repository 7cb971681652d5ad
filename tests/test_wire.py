"""Shared server frames are byte-identical to what wsproto would send."""

from hypothesis import given
from hypothesis import strategies as st
from wsproto.frame_protocol import FrameProtocol

from server.wire import server_frame


def wsproto_frame(payload: bytes, binary: bool) -> bytes:
    protocol = FrameProtocol(client=False, extensions=[])
    return protocol.send_data(payload if binary else payload.decode(), fin=True)


@given(st.one_of(st.binary(max_size=300), st.binary(min_size=65530, max_size=65545)), st.booleans())
def test_server_frame_matches_wsproto(payload, binary):
    if not binary:
        payload = payload.decode("latin-1").encode()  # any valid UTF-8
    assert server_frame(payload, binary=binary) == wsproto_frame(payload, binary)


def test_large_frame_uses_the_64_bit_length():
    payload = b"x" * 70_000
    assert server_frame(payload, binary=True) == wsproto_frame(payload, True)
