"""Attachment storage drivers: where an attachment's bytes live once its upload is
finished.  `local` keeps them in a directory; `s3` in a bucket of any
S3-compatible service (boto3, run in worker threads: trio has no native S3
client).  An attachment row names its driver and object key, so objects written
under one driver stay readable after the deployment's default changes, as long as
that driver stays configured."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import trio


class BlobMissing(Exception):
    """The object a row names is not in the store."""


class BlobStoreUnavailable(Exception):
    """The store did not answer (or refused): the operation may succeed later."""


class BlobStore(Protocol):
    name: str

    async def put(self, key: str, staged: Path) -> None:
        """Store the finished staging file under `key` (the file is consumed)."""

    async def read(self, key: str, offset: int, length: int) -> bytes: ...

    async def delete(self, key: str) -> None:
        """Idempotent: a missing object is not an error."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalBlobs:
    name = "local"

    def __init__(self, root: Path) -> None:
        self.root = root / "objects"
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        # Keys are server-made (`<workspace>/<attachment id>`), never a client's path.
        return self.root / key

    async def put(self, key: str, staged: Path) -> None:
        def move() -> None:
            target = self._path(key)
            target.parent.mkdir(parents=True, exist_ok=True)
            # Durable before the row says `stored`: the bytes, then the name.
            with open(staged, "rb") as file:
                os.fsync(file.fileno())
            os.replace(staged, target)  # staging and objects share the attachments directory
            _fsync_dir(target.parent)
        await trio.to_thread.run_sync(move)

    async def read(self, key: str, offset: int, length: int) -> bytes:
        def read() -> bytes:
            try:
                with open(self._path(key), "rb") as file:
                    file.seek(offset)
                    return file.read(length)
            except FileNotFoundError:
                raise BlobMissing(key) from None
        return await trio.to_thread.run_sync(read)

    async def delete(self, key: str) -> None:
        await trio.to_thread.run_sync(lambda: self._path(key).unlink(missing_ok=True))


@dataclass(frozen=True)
class S3Settings:
    endpoint_url: str | None
    bucket: str
    region: str
    access_key: str | None
    secret_key: str | None
    prefix: str = ""


class S3Blobs:
    name = "s3"

    def __init__(self, settings: S3Settings) -> None:
        import boto3  # only deployments using S3 pay for importing it

        self.settings = settings
        self.client = boto3.client(
            "s3", endpoint_url=settings.endpoint_url, region_name=settings.region,
            aws_access_key_id=settings.access_key, aws_secret_access_key=settings.secret_key)

    def _key(self, key: str) -> str:
        return self.settings.prefix + key

    async def _call(self, work):
        from boto3.exceptions import Boto3Error
        from botocore.exceptions import BotoCoreError, ClientError

        def guarded():
            try:
                return work()
            except self.client.exceptions.NoSuchKey:
                raise BlobMissing() from None
            except (Boto3Error, BotoCoreError, ClientError) as exc:
                raise BlobStoreUnavailable(str(exc)) from exc
        return await trio.to_thread.run_sync(guarded)

    async def put(self, key: str, staged: Path) -> None:
        def upload() -> None:
            # upload_file switches to a multipart upload for large files.
            self.client.upload_file(str(staged), self.settings.bucket, self._key(key))
            staged.unlink(missing_ok=True)
        await self._call(upload)

    async def read(self, key: str, offset: int, length: int) -> bytes:
        def read() -> bytes:
            answer = self.client.get_object(Bucket=self.settings.bucket, Key=self._key(key),
                                            Range=f"bytes={offset}-{offset + length - 1}")
            return answer["Body"].read()
        return await self._call(read)

    async def delete(self, key: str) -> None:
        await self._call(lambda: self.client.delete_object(Bucket=self.settings.bucket, Key=self._key(key)))
