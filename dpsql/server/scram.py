"""SCRAM-SHA-256 (RFC 5802 / RFC 7677) as PostgreSQL speaks it, server side.

Only the verifier (salt, iterations, StoredKey, ServerKey) is ever stored; the password never
is. Channel binding (SCRAM-SHA-256-PLUS) is not offered, so a client that *requires* it ("p=")
is refused, and one that supports it but saw no offer ("y,,") is accepted, as RFC 5802 says.

An unknown user gets a complete fake exchange (a salt derived from a per-server secret and the
user name, so repeated attempts look stable) and then the same failure as a wrong password.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import unicodedata
from dataclasses import dataclass

MECHANISM = "SCRAM-SHA-256"
DEFAULT_ITERATIONS = 4096  # PostgreSQL's default scram_iterations


class ScramError(Exception):
    """The exchange failed; ``sqlstate`` is 28P01 (bad password) or 08P01 (malformed)."""

    def __init__(self, message: str, sqlstate: str = "28P01") -> None:
        super().__init__(message)
        self.message = message
        self.sqlstate = sqlstate


@dataclass(frozen=True)
class Verifier:
    salt: bytes
    iterations: int
    stored_key: bytes
    server_key: bytes

    def to_dict(self) -> dict[str, object]:
        b64 = base64.b64encode
        return {
            "mechanism": MECHANISM,
            "iterations": self.iterations,
            "salt": b64(self.salt).decode(),
            "stored_key": b64(self.stored_key).decode(),
            "server_key": b64(self.server_key).decode(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> Verifier:
        def b(key: str) -> bytes:
            return base64.b64decode(str(data[key]), validate=True)

        return cls(b("salt"), int(data["iterations"]), b("stored_key"), b("server_key"))  # type: ignore[call-overload]


def _hmac(key: bytes, msg: bytes) -> bytes:
    return hmac.new(key, msg, hashlib.sha256).digest()


def normalize_password(password: str) -> bytes:
    """A SASLprep approximation: NFKC, as PostgreSQL applies before hashing (RFC 4013)."""
    return unicodedata.normalize("NFKC", password).encode("utf-8")


def make_verifier(
    password: str, *, salt: bytes | None = None, iterations: int = DEFAULT_ITERATIONS
) -> Verifier:
    salt = salt if salt is not None else secrets.token_bytes(16)
    salted = hashlib.pbkdf2_hmac("sha256", normalize_password(password), salt, iterations)
    client_key = _hmac(salted, b"Client Key")
    stored_key = hashlib.sha256(client_key).digest()
    server_key = _hmac(salted, b"Server Key")
    return Verifier(salt, iterations, stored_key, server_key)


def _attributes(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in text.split(","):
        if len(part) < 2 or part[1] != "=":
            raise ScramError("malformed SCRAM message", "08P01")
        out.setdefault(part[0], part[2:])
    return out


class ScramExchange:
    """One server-side exchange. ``verifier=None`` runs the mock exchange for unknown users."""

    def __init__(self, verifier: Verifier | None, *, mock_secret: bytes, user: str) -> None:
        if verifier is None:
            salt = _hmac(mock_secret, b"salt:" + user.encode("utf-8"))[:16]
            verifier = Verifier(salt, DEFAULT_ITERATIONS, secrets.token_bytes(32), b"")
            self.mock = True
        else:
            self.mock = False
        self.verifier = verifier
        self.server_nonce = base64.b64encode(secrets.token_bytes(18)).decode()
        self._client_first_bare = ""
        self._server_first = ""
        self._gs2_header = ""
        self._nonce = ""

    def first(self, client_first: bytes) -> bytes:
        """client-first-message -> server-first-message."""
        try:
            text = client_first.decode("utf-8")
        except UnicodeDecodeError:
            raise ScramError("malformed SCRAM message (not UTF-8)", "08P01") from None
        if text.startswith("p="):
            raise ScramError(
                "channel binding was required by the client but is not supported", "28000"
            )
        if not (text.startswith("n,") or text.startswith("y,")):
            raise ScramError("malformed SCRAM message (invalid GS2 header)", "08P01")
        comma = text.find(",", 2)
        if comma < 0:
            raise ScramError("malformed SCRAM message", "08P01")
        self._gs2_header = text[: comma + 1]
        bare = text[comma + 1 :]
        attrs = _attributes(bare)
        if "r" not in attrs or not attrs["r"] or "m" in attrs:
            raise ScramError("malformed SCRAM message (missing nonce)", "08P01")
        self._client_first_bare = bare
        self._nonce = attrs["r"] + self.server_nonce
        salt = base64.b64encode(self.verifier.salt).decode()
        self._server_first = f"r={self._nonce},s={salt},i={self.verifier.iterations}"
        return self._server_first.encode()

    def final(self, client_final: bytes) -> bytes:
        """client-final-message -> server-final-message, or ScramError on a bad proof."""
        try:
            text = client_final.decode("utf-8")
        except UnicodeDecodeError:
            raise ScramError("malformed SCRAM message (not UTF-8)", "08P01") from None
        idx = text.rfind(",p=")
        if idx < 0:
            raise ScramError("malformed SCRAM message (missing proof)", "08P01")
        without_proof = text[:idx]
        attrs = _attributes(text)
        expected_binding = base64.b64encode(self._gs2_header.encode()).decode()
        if attrs.get("c") != expected_binding:
            raise ScramError("SCRAM channel binding check failed", "08P01")
        if attrs.get("r") != self._nonce:
            raise ScramError("SCRAM nonce mismatch", "08P01")
        try:
            proof = base64.b64decode(attrs["p"], validate=True)
        except (ValueError, KeyError):
            raise ScramError("malformed SCRAM proof", "08P01") from None
        auth_message = f"{self._client_first_bare},{self._server_first},{without_proof}".encode()
        signature = _hmac(self.verifier.stored_key, auth_message)
        if len(proof) != len(signature):
            raise ScramError("malformed SCRAM proof", "08P01")
        client_key = bytes(a ^ b for a, b in zip(proof, signature, strict=True))
        ok = hmac.compare_digest(hashlib.sha256(client_key).digest(), self.verifier.stored_key)
        if not ok or self.mock:
            raise ScramError("password authentication failed")
        server_signature = _hmac(self.verifier.server_key, auth_message)
        return b"v=" + base64.b64encode(server_signature)
