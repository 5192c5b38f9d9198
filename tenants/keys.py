"""API key secrets: generation, the stored hash and the display prefix.

Keys are 32 random bytes (`sk-sluice-<base64url>`), so a plain SHA-256 is
enough to store them: there is nothing to brute-force, unlike passwords.
Lookups go by hash; the final comparison is constant-time anyway so a
cached or mistyped record can never leak timing.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

KEY_PREFIX = "sk-sluice-"
ADMIN_KEY_PREFIX = "sk-sluice-admin-"
DISPLAY_CHARS = 14  # "sk-sluice-" plus 4 random characters: enough to tell keys apart in a list


def generate_key(prefix: str = KEY_PREFIX) -> str:
    return prefix + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def display_prefix(key: str) -> str:
    return key[:DISPLAY_CHARS]


def matches(key: str, key_hash: str) -> bool:
    return hmac.compare_digest(hash_key(key), key_hash)
