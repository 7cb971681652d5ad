"""The committed machine-readable spec matches the Structs; decoding is total."""

import json

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from protocol import frames
from protocol.codec import decode_request
from protocol.errors import ErrorCode, ProtocolError
from protocol.spec import SPEC_PATH, render


def test_committed_spec_is_current():
    assert SPEC_PATH.read_text() == render(), "run `python -m protocol.spec` and commit protocol.schema.json"


def test_spec_names_every_op_and_code():
    spec = json.loads(SPEC_PATH.read_text())
    tags = {d["properties"]["op"]["enum"][0] for d in spec["$defs"].values()
            if "op" in d.get("properties", {}) and "enum" in d["properties"]["op"]}
    assert tags == frames.KNOWN_OPS
    assert set(spec["error_codes"]) == {c.value for c in ErrorCode}


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20)


@given(st.one_of(
    st.binary(max_size=200),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.dictionaries(st.sampled_from(["op", "id", "scope_id", "content", "workspace_id", "limit", "x"]),
                    json_values, max_size=6).map(lambda v: json.dumps(v).encode()),
    st.builds(lambda op, body: json.dumps({"op": op, "id": "1", **body}).encode(),
              st.sampled_from(sorted(frames.KNOWN_OPS)),
              st.dictionaries(st.text(max_size=12), json_values, max_size=4)),
))
def test_any_input_decodes_to_a_request_or_a_typed_error(raw):
    for binary, payload in ((False, raw), (True, msgspec.msgpack.encode(raw))):
        try:
            request = decode_request(payload, binary=binary)
        except ProtocolError as exc:
            assert exc.code in (ErrorCode.BAD_FRAME, ErrorCode.UNKNOWN_OP, ErrorCode.INVALID)
        else:
            assert isinstance(request, frames.CLIENT_FRAMES)
