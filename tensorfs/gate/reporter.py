"""What a gate tells whoever serves its bytes: nothing, by default (the library); a mount logs and
counts it (mount/checks.py)."""

from __future__ import annotations

from ..sources.watch import Change
from ..utils.identity import ShardKey

__all__ = ["Reporter"]


class Reporter:
    """What the gate tells whoever serves its bytes (a mount logs and counts it): nothing, by default.
    Called in the thread that drives the plan, under the gate's lock: quick, and never blocking."""

    def verified(self, name: str) -> None:
        """A tensor's bytes matched the manifest."""

    def mismatch(self, name: str, shard: ShardKey, actual: str, expected: str, said: str | None = None) -> None:
        """A tensor's bytes do not match the manifest (said once per tensor until its shard changes);
        `said`, when what they failed is not the tensor's own digest (a signature's range): how."""

    def unverifiable(self, name: str, shard: ShardKey, why: str) -> None:
        """A tensor's bytes could not be read to be hashed (said once, as a mismatch)."""

    def changed(self, shard: ShardKey, names: list[str], *, manifest: bool, had_verified: bool) -> None:
        """A shard's bytes may have changed in place (anything the kernel reports of its file): its
        tensors refused from now on (no manifest), or verified again (`had_verified`: some of them
        were verified since its last change)."""

    def held(self, shard: ShardKey, *, again: bool = False) -> None:
        """A shard's file changed with no manifest: its bytes served so far are checked before another
        goes out (its attributes may have changed: a mount shows them anew); `again`: changed again
        before it was checked (one check for both)."""

    def unchanged(self, shard: ShardKey) -> None:
        """A held shard's bytes served so far are as they were: served on."""

    def moved(self, shard: ShardKey, change: Change) -> None:
        """A shard was renamed or deleted: its file (validated, open) is still what is served."""

    def refused(self, name: str, shard: ShardKey) -> None:
        """A tensor of a shard changed in place (no manifest) was asked for (said once per tensor)."""

    def fell_back(self, name: str, source: str) -> None:
        """A tensor is served from fallback `source` from now on."""
