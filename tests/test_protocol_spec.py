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


# --- the typed contract and the AsyncAPI document --------------------------------------------------

from pathlib import Path  # noqa: E402

import jsonschema  # noqa: E402

from protocol import asyncapi, results  # noqa: E402
from protocol.events import EVENT_FRAMES, EVENTS  # noqa: E402

ASYNCAPI_SCHEMA = Path(__file__).parent / "data" / "asyncapi-3.0.0.schema.json"


def test_committed_asyncapi_document_is_current():
    assert asyncapi.ASYNCAPI_PATH.read_text() == asyncapi.render(), \
        "run `python -m protocol.spec` and commit protocol/asyncapi.json"


def test_asyncapi_document_is_valid_asyncapi_3():
    document = json.loads(asyncapi.ASYNCAPI_PATH.read_text())
    errors = list(jsonschema.Draft7Validator(json.loads(ASYNCAPI_SCHEMA.read_text())).iter_errors(document))
    assert not errors, [f"{list(e.absolute_path)}: {e.message[:200]}" for e in errors[:5]]
    # The official schema does not follow references: every one must resolve inside the document.
    def resolve(pointer: str):
        node = document
        for part in pointer.removeprefix("#/").split("/"):
            node = node[part.replace("~1", "/").replace("~0", "~")]
        return node

    def refs(node):
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str):
                yield node["$ref"]
            for value in node.values():
                yield from refs(value)
        elif isinstance(node, list):
            for value in node:
                yield from refs(value)

    for ref in set(refs(document)):
        assert ref.startswith("#/"), ref
        resolve(ref)


def test_asyncapi_covers_every_op_event_and_close_code():
    document = json.loads(asyncapi.ASYNCAPI_PATH.read_text())
    operations = document["operations"]
    for op in frames.KNOWN_OPS:
        assert operations[op]["action"] == "send"
        replies = {m["$ref"].rsplit("/", 1)[1] for m in operations[op]["reply"]["messages"]}
        assert replies == {f"{op}.result", "error"}
        result_schema = document["components"]["messages"][f"{op}.result"]["payload"]["$ref"].rsplit("/", 1)[1]
        assert result_schema == results.RESULT_FRAMES[op].__name__
    for event in EVENTS:
        assert operations[f"on.{event}"]["action"] == "receive"
    assert set(document["x-scopewire-close-codes"]) >= {str(frames.CLOSE_SLOW_CONSUMER), str(frames.CLOSE_REVOKED)}
    assert frames.MSGPACK_SUBPROTOCOL in document["servers"]["scopewire"]["description"]
    assert "Auth flow" in document["info"]["description"]


def test_json_schema_types_every_result_and_event():
    spec = json.loads(SPEC_PATH.read_text())
    assert set(spec["results"]) == frames.KNOWN_OPS
    assert set(spec["events"]) == set(EVENTS)
    for op, result in results.RESULTS_BY_OP.items():
        assert spec["results"][op] == {"$ref": f"#/$defs/{result.__name__}"}
    server_frames = {ref["$ref"].rsplit("/", 1)[1] for ref in spec["server_frame"]["oneOf"]}
    assert server_frames == ({"Error"} | {t.__name__ for t in results.RESULT_FRAMES.values()}
                             | {t.__name__ for t in EVENT_FRAMES.values()})
    # List results are objects with a named list field (extensible), never bare arrays.
    for op in ("channel.list", "member.list", "scope.members", "workspace.list", "invitation.list", "apikey.list"):
        definition = spec["$defs"][results.RESULTS_BY_OP[op].__name__]
        assert definition["type"] == "object"
        (field,) = definition["required"]
        assert definition["properties"][field]["type"] == "array"
