"""Signatures verified before, by their bytes and the bytes of the public key that verified them: a
later open of a model held to the same signature with the same key takes what the signature says
from here, without model_signing (importing it costs more than a warm open of a model takes:
docs/performance.md). What is kept is what was verified and accepted; a signature or a key changed
by one byte is another row. Certificate chains are verified every time (a certificate's validity
is a matter of time, not of its bytes). The cache's own trust: its directory is this user's alone
(sqlite.py), as the hash cache's is, which vouches for bytes the same way."""

from __future__ import annotations

import sqlite3

from .sqlite import SqliteCache


class VerifiedSignatures(SqliteCache):
    """What verified signatures said (signing.SignedModel, as JSON), by (SHA-256 of the signature,
    SHA-256 of the key, the rules that verified it); safe for several processes at once. A result
    kept under other rules (a tensorfs or a model_signing that verified otherwise) is never taken."""

    FILE_NAME = "signatures.sqlite"
    TABLE = (
        "CREATE TABLE IF NOT EXISTS verified (bundle TEXT, material TEXT, rules TEXT, said TEXT NOT NULL,"
        " PRIMARY KEY (bundle, material, rules)) WITHOUT ROWID"
    )
    OBSOLETE = ("signatures",)  # rows kept under no rules (up to d4c56fe): never read, dropped
    NAME = "cache of verified signatures"

    def get(self, bundle: str, material: str, rules: str) -> str | None:
        def said(connection: sqlite3.Connection) -> str | None:
            row = connection.execute(
                "SELECT said FROM verified WHERE bundle=? AND material=? AND rules=?", (bundle, material, rules)
            ).fetchone()
            return None if row is None else str(row[0])

        return self._with_connection(said, None)

    def put(self, bundle: str, material: str, rules: str, said: str) -> None:
        def keep(connection: sqlite3.Connection) -> None:
            with connection:
                connection.execute(
                    "INSERT OR REPLACE INTO verified VALUES (?, ?, ?, ?)", (bundle, material, rules, said)
                )

        self._with_connection(keep, None)
