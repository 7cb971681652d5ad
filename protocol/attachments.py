"""Attachments (scope-model.md §3.11): upload in chunks over the protocol, claim by a
message, read through the owning message's visibility.

An upload belongs to one scope and one uploader.  `attachment.upload.begin` declares
its name, type and size (and, optionally, its SHA-256); `attachment.upload.chunk`
sends the bytes in order, each at the offset the server has received so far (a
reconnecting client asks `attachment.get` for `received_bytes` and goes on from
there); `attachment.upload.finish` checks the size, the digest and the content
type against the bytes, and stores the object with the deployment's storage
driver (a local directory, or an S3-compatible bucket).  `message.send` then
claims stored uploads with `attachment_ids` (at most
MAX_ATTACHMENTS_PER_MESSAGE), in the message's own transaction:
an id that is unknown, someone else's, of another scope, not finished, or
already claimed answers `not_found` (reason `attachment_not_found`) and nothing
is written.  A claimed attachment is read by whoever may read its message (the
one readable predicate of history); an unclaimed one by its uploader only.
Uploads never claimed are deleted after the deployment's TTL.

Errors carry `details.reason`: `too_large` for `file_too_large`,
`chunk_past_end` and `upload_quota_exceeded`; `invalid` for
`content_type_not_allowed`, `content_type_mismatch` (the bytes are not what the
type says), `digest_mismatch`, `bad_filename`, `bad_label`; `conflict` for
`offset_mismatch` (with `details.received_bytes`), `upload_incomplete`,
`upload_finished`; `unavailable` (`store_unavailable`) when the storage cannot
be reached; `not_found` for anything you cannot see.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from protocol.frames import Id, Ok, Request, WorkspaceRequest

# Raw bytes per chunk, either way: in JSON a chunk is base64 (4/3 larger), so a
# whole chunk frame stays well inside the default 256 KiB frame limit.
MAX_CHUNK_BYTES = 128 * 1024

Filename = Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
Label = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
ContentType = Annotated[str, msgspec.Meta(min_length=3, max_length=127,
                                          pattern=r"^[a-z0-9][a-z0-9!#$&^_.+-]*/[a-z0-9][a-z0-9!#$&^_.+-]*$")]
ByteSize = Annotated[int, msgspec.Meta(ge=1, le=2**53)]
Offset = Annotated[int, msgspec.Meta(ge=0, le=2**53)]
Sha256 = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]
Chunk = Annotated[bytes, msgspec.Meta(min_length=1, max_length=MAX_CHUNK_BYTES)]
ReadLength = Annotated[int, msgspec.Meta(ge=1, le=MAX_CHUNK_BYTES)]
UploadState = Literal["uploading", "stored", "claimed"]


class AttachmentUploadBegin(WorkspaceRequest, tag="attachment.upload.begin"):
    """Start an upload into a scope you may write to.  `content_type` is lower case
    (`type/subtype`, no parameters) and must be one the deployment allows; `byte_size` at
    most its limit (`too_large`, reason `file_too_large`).  `label` (default: the
    filename) is what search finds the attachment by."""

    scope_id: Id
    filename: Filename
    content_type: ContentType
    byte_size: ByteSize
    sha256: Sha256 | None = None
    label: Label | None = None


class AttachmentUploadChunk(WorkspaceRequest, tag="attachment.upload.chunk"):
    """The next bytes of your upload: `offset` must equal the bytes received so far
    (`conflict`, reason `offset_mismatch`, with `details.received_bytes`), and the chunk
    must not go past the declared size.  `data` is base64 in JSON, raw bytes in msgpack."""

    attachment_id: Id
    offset: Offset
    data: Chunk


class AttachmentUploadFinish(WorkspaceRequest, tag="attachment.upload.finish"):
    """Check and store a fully received upload; it can then be claimed by a message.
    Finishing a stored upload again answers it again."""

    attachment_id: Id


class AttachmentUploadAbort(WorkspaceRequest, tag="attachment.upload.abort"):
    """Delete your upload (in progress or stored) before a message claims it."""

    attachment_id: Id


class AttachmentGet(WorkspaceRequest, tag="attachment.get"):
    """An attachment's description: yours while unclaimed, then whoever may read its message."""

    attachment_id: Id


class AttachmentRead(WorkspaceRequest, tag="attachment.read"):
    """Up to `length` bytes of a stored attachment from `offset` (same authorization as
    `attachment.get`); `eof` says the end was reached."""

    attachment_id: Id
    offset: Offset = 0
    length: ReadLength = MAX_CHUNK_BYTES


FRAMES = (AttachmentUploadBegin, AttachmentUploadChunk, AttachmentUploadFinish, AttachmentUploadAbort,
          AttachmentGet, AttachmentRead)


# --- results ----------------------------------------------------------------------------------------

class AttachmentInfo(msgspec.Struct, omit_defaults=True):
    id: str
    scope_id: str
    uploaded_by_member_id: str
    filename: str
    label: str
    content_type: str
    byte_size: int
    state: UploadState
    received_bytes: int
    created_at_ms: int
    max_chunk_bytes: int
    sha256: str | None = None
    message_id: str | None = None
    # Until then an unclaimed upload is deleted (absent once claimed).
    expires_at_ms: int | None = None


class AttachmentData(msgspec.Struct):
    attachment_id: str
    offset: int
    data: bytes
    eof: bool


RESULTS: dict[type[Request], type[msgspec.Struct]] = {
    AttachmentUploadBegin: AttachmentInfo, AttachmentUploadChunk: AttachmentInfo,
    AttachmentUploadFinish: AttachmentInfo, AttachmentUploadAbort: Ok, AttachmentGet: AttachmentInfo,
    AttachmentRead: AttachmentData,
}
