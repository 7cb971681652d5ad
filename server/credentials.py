"""Secrets: password hashes, session tokens, API keys and invitation tokens.

- Passwords: scrypt (memory-hard) from `cryptography`, with a per-password salt.
- Session tokens: Ed25519-signed, compact `header.claims.signature` (base64url)
  carrying sub, iss, aud, iat, exp, jti, token_version (workspace-multi-tenant.md
  §9.2).  Nothing about them is stored; bumping the account's token_version
  revokes all of them.
- API keys and invitation tokens: 256 random bits; only their SHA-256 is
  stored.  A fast hash is right here: the input is uniformly random, so there
  is nothing to brute-force, and lookups stay one index probe.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

API_KEY_PREFIX = "swk_"
INVITATION_PREFIX = "swi_"
SECRET_BYTES = 32  # 256 bits

# scrypt cost: n=2^15, r=8 → 32 MiB and ~50 ms per hash on this class of machine.
_SCRYPT_N, _SCRYPT_R, _SCRYPT_P, _SCRYPT_LEN = 2**15, 8, 1, 32


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


# --- passwords -----------------------------------------------------------------------

def hash_password(password: str) -> str:
    salt = os.urandom(16)
    digest = Scrypt(salt=salt, length=_SCRYPT_LEN, n=_SCRYPT_N, r=_SCRYPT_R, p=_SCRYPT_P).derive(password.encode())
    return f"scrypt${_SCRYPT_N}${_SCRYPT_R}${_SCRYPT_P}${_b64(salt)}${_b64(digest)}"


def verify_password(password: str, encoded: str) -> bool:
    try:
        scheme, n, r, p, salt, digest = encoded.split("$")
        if scheme != "scrypt":
            return False
        derived = Scrypt(salt=_unb64(salt), length=len(_unb64(digest)), n=int(n), r=int(r), p=int(p)).derive(
            password.encode()
        )
    except (ValueError, TypeError):
        return False
    return hmac.compare_digest(derived, _unb64(digest))


# A hash to verify against when the account does not exist, so timing does not
# reveal which emails are registered: the same scrypt cost as a real one (its digest
# matches no password, and a match would not count), built without hashing so that
# importing this module (every CLI command) costs no scrypt run.
DUMMY_PASSWORD_HASH = f"scrypt${_SCRYPT_N}${_SCRYPT_R}${_SCRYPT_P}${_b64(bytes(16))}${_b64(bytes(_SCRYPT_LEN))}"


def generate_password() -> str:
    return secrets.token_urlsafe(18)


# --- random secrets (API keys, invitation tokens) --------------------------------------

def generate_secret(prefix: str) -> str:
    return prefix + secrets.token_urlsafe(SECRET_BYTES)


def secret_hash(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


# --- session tokens --------------------------------------------------------------------

# Who issues session tokens and who accepts them: a token minted for another
# audience (or by another issuer) with the same key is refused.
SESSION_ISSUER = "scopewire"
SESSION_AUDIENCE = "scopewire:websocket"


class SessionClaims(msgspec.Struct, forbid_unknown_fields=True):
    sub: str
    iss: str
    aud: str
    iat: int
    exp: int
    jti: str
    token_version: int


_HEADER = _b64(b'{"alg":"EdDSA","typ":"JWT"}')
_claims_decoder = msgspec.json.Decoder(SessionClaims)


class InvalidToken(Exception):
    pass


@dataclass(frozen=True)
class SessionSigner:
    private_key: Ed25519PrivateKey

    @property
    def public_key(self) -> Ed25519PublicKey:
        return self.private_key.public_key()

    def issue(self, account_id: str, token_version: int, ttl_seconds: int) -> tuple[str, SessionClaims]:
        now = int(time.time())
        claims = SessionClaims(sub=account_id, iss=SESSION_ISSUER, aud=SESSION_AUDIENCE, iat=now,
                               exp=now + ttl_seconds, jti=secrets.token_hex(16), token_version=token_version)
        signing_input = f"{_HEADER}.{_b64(msgspec.json.encode(claims))}"
        signature = self.private_key.sign(signing_input.encode())
        return f"{signing_input}.{_b64(signature)}", claims

    def verify(self, token: str, now: float | None = None) -> SessionClaims:
        """Claims of a well-signed, unexpired token from our issuer for our
        audience; InvalidToken otherwise."""
        try:
            header, claims_part, signature = token.split(".")
            if header != _HEADER:
                raise InvalidToken("unsupported token header")
            self.public_key.verify(_unb64(signature), f"{header}.{claims_part}".encode())
            claims = _claims_decoder.decode(_unb64(claims_part))
        except (ValueError, InvalidSignature, msgspec.DecodeError) as exc:
            raise InvalidToken("invalid session token") from exc
        if claims.iss != SESSION_ISSUER or claims.aud != SESSION_AUDIENCE:
            raise InvalidToken("session token for another issuer or audience")
        if claims.exp <= (now if now is not None else time.time()):
            raise InvalidToken("session token expired")
        return claims


def load_or_create_signer(path: Path) -> SessionSigner:
    """The instance's session signing key, created (mode 0600) on first use.
    Every process serving one database must share this file."""
    if path.exists():
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"{path} is not an Ed25519 private key")
        return SessionSigner(key)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(pem)
    try:
        os.link(tmp, path)  # atomic and fails if another process won the race
    except FileExistsError:
        os.unlink(tmp)
        return load_or_create_signer(path)
    os.unlink(tmp)
    return SessionSigner(key)
