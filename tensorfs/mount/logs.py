"""The daemon's log: one file per mount by default, reopened on SIGHUP (logrotate's convention).

A fatal signal (SIGSEGV, SIGBUS, ...) is reported in the log too (faulthandler), so that
`tensorfs status` can say why a daemon died.
"""

from __future__ import annotations

import faulthandler
import io
import json
import logging
import os
import sys
from pathlib import Path

from ..errors import MountError
from ..fs.writer import open_append
from ..sources.store import redact
from .runtime import escape_path

FORMAT = "%(asctime)s tensorfs[%(process)d] %(levelname)s %(message)s"


def log_dir() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(state) / "tensorfs"


def default_log_file(mountpoint: Path) -> Path:
    """$XDG_STATE_HOME/tensorfs/<mountpoint, escaped as systemd does>.log: one file per mount."""
    return log_dir() / f"{escape_path(mountpoint)}.log"


class ReopeningFileHandler(logging.FileHandler):
    """A log file that can be closed and opened again by name, after logrotate moved it away.

    Made readable by its owner alone: it names models, files and tensors (a log file that exists
    keeps the mode it has). Opened by the one writer's rule for appending: never through a symlink
    at its name, only a regular file (a FIFO or a device there is refused, never waited on).
    """

    def _open(self) -> io.TextIOWrapper:
        return open(open_append(Path(self.baseFilename)), "a", encoding=self.encoding, errors=self.errors)

    def reopen(self) -> None:
        """Open the file by its name again; OSError (and the old file kept) if it cannot be."""
        fresh = self._open()  # first: if this fails, logging goes on to the file it had
        self.acquire()
        try:
            old, self.stream = self.stream, fresh
            faulthandler.enable(fresh)
            if old is not None:
                old.close()
        finally:
            self.release()


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, pid, event (the message), and the record's `fields`
    (tensor, shard, errno, ...) when it carries them; a traceback as one string. No line, in
    either format, shows a URL's user:password."""

    def format(self, record: logging.LogRecord) -> str:
        document: dict[str, object] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname,
            "pid": record.process,
            "event": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            document["fields"] = fields
        if record.exc_info:
            document["traceback"] = self.formatException(record.exc_info)
        return redact(json.dumps(document, ensure_ascii=False, default=str))


class TextFormatter(logging.Formatter):
    """FORMAT's lines (a traceback after its line)."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


LOG_FORMATS = ("text", "json")


def setup_logging(log_file: Path | None, *, debug: bool, log_format: str = "text") -> None:
    """Log to `log_file` (None: stderr) at INFO, or DEBUG, as text or JSON lines; a file that
    cannot be written is a MountError."""
    handler: logging.Handler
    if log_file is None:
        handler = logging.StreamHandler(sys.stderr)
        faulthandler.enable(sys.stderr)
    else:
        try:
            log_file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            handler = ReopeningFileHandler(log_file, encoding="utf-8")
        except OSError as exc:
            raise MountError(f"cannot write the log file {log_file}: {exc.strerror}") from None
        assert handler.stream is not None
        faulthandler.enable(handler.stream)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter(FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if debug else logging.INFO)


def reopen_logs() -> str:
    """Reopen every log file (SIGHUP); what was done, in words (it never fails: the daemon goes on)."""
    done = "no log file to reopen"
    for handler in logging.getLogger().handlers:
        if isinstance(handler, ReopeningFileHandler):
            try:
                handler.reopen()
                done = "reopened the log file"
            except OSError as exc:
                return (
                    f"could not reopen the log file {handler.baseFilename} ({exc.strerror}): logging on to the old one"
                )
    return done
