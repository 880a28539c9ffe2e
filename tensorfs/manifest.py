"""The manifest format: a tensor's SHA-256 by name, as `sha256sum` writes it (GNU's escaping of
names) or as JSON. Only the text: where a manifest is found and read is the source's business."""

from __future__ import annotations

import json
from collections.abc import Mapping

from .errors import TensorfsError, printable

DEFAULT_MANIFEST = "tensors.sha256"
"""The manifest looked for beside a model's shards."""


def _escape(name: str) -> tuple[str, str]:
    """GNU sha256sum's escaping of a file name: (prefix for the line, escaped name)."""
    if "\\" in name or "\n" in name or "\r" in name:
        return "\\", name.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")
    return "", name


def sha256sum_line(hex_digest: str, name: str) -> str:
    """One line in the format `sha256sum` writes and `sha256sum -c` reads."""
    prefix, escaped = _escape(name)
    return f"{prefix}{hex_digest}  {escaped}\n"


def format_manifest(digests: Mapping[str, str], *, as_json: bool = False) -> str:
    if as_json:
        return json.dumps(dict(sorted(digests.items())), indent=2, ensure_ascii=False) + "\n"
    return "".join(sha256sum_line(digests[name], name) for name in sorted(digests))


class ManifestError(TensorfsError):
    """A manifest file that cannot be read."""


def parse_manifest(text: str, source: str) -> dict[str, str]:
    """Tensor name -> hex digest from a manifest in sha256sum format or JSON ({name: hex})."""
    if text.lstrip().startswith("{"):
        try:
            document = json.loads(text)
        except ValueError as exc:
            raise ManifestError(f"{source}: not valid JSON: {exc}") from None
        if not isinstance(document, dict) or not all(
            isinstance(v, str) and _is_hex_digest(v) for v in document.values()
        ):
            raise ManifestError(f"{source}: a JSON manifest maps tensor names to 64-digit hex SHA-256 strings")
        return {name: digest.lower() for name, digest in document.items()}
    digests: dict[str, str] = {}
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        escaped = line.startswith("\\")
        body = line[1:] if escaped else line
        digest, separator, name = body[:64], body[64:66], body[66:]
        if not _is_hex_digest(digest) or separator not in ("  ", " *") or not name:
            raise ManifestError(f"{source}:{number}: not a sha256sum line: {printable(line[:80])}")
        if escaped:
            name = _unescape(name)
        if name in digests:
            raise ManifestError(f"{source}:{number}: tensor '{printable(name)}' is listed twice")
        digests[name] = digest.lower()
    return digests


def _unescape(name: str) -> str:
    out, chars = [], iter(name)
    for ch in chars:
        if ch == "\\":
            nxt = next(chars, "")
            out.append({"n": "\n", "r": "\r", "\\": "\\"}.get(nxt, "\\" + nxt))
        else:
            out.append(ch)
    return "".join(out)


def _is_hex_digest(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdefABCDEF" for c in text)


MAX_MANIFEST_BYTES = 256 << 20
"""A manifest of a million tensors is about 100 MB: one past this is not a manifest (or never ends)."""
