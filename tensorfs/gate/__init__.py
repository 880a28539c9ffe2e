"""The gate: the only code that turns "tensor, byte range" into bytes that may be handed out, under a
mount and in-process alike.

Before any byte of a tensor goes out, the gate decides, in this order:

1. where the bytes are had: the tensor's own shard, or the fallback copy it was switched to;
2. whether that place may give them now: a shard whose reads failed a moment ago sends its tensors
   to their fallbacks at once (but for bytes it holds without asking); every change to the files
   reported so far is applied (a shard or a copy written in place is refused without a manifest,
   and verified again with one);
3. whether the tensor is verified: under a manifest, no byte goes out before the bytes hash to the
   manifest's value (the hash cache first); a copy is hashed before it is served;
4. that the bytes are present (a remote shard's chunks fetched, and pinned) — how, the caller says
   (the mount brings pages in off its thread, and reads ahead);
5. and when any of that fails because the bytes cannot be had or are wrong, the next fallback whose
   copy agrees (its table, and the manifest), or the error.

The sequence is written once, as a plan: a generator that does the quick steps itself and yields each
blocking one (hashing, fetching, opening a fallback) as a call for its driver to make. `run()` makes
them in the calling thread (the library); the mount makes them on worker threads and answers its
requests meanwhile. Plans change the gate's state only in the thread that drives them, under its lock.

    plans.py     the vocabulary: plans and their steps, run(), the place bytes are had from, grants
    reporter.py  what a gate tells whoever serves its bytes (a mount logs and counts it)
    files.py     the files its bytes come from, watched, and what was seen of each
    router.py    the fallback router: the copy each tensor is served from, the next that agrees, the retry rule
    digests.py   tensors' SHA-256s as they are now, hashed once however many ask
    spans.py     many tensors' bytes of one file at once (a view's file read at the cost of its bytes)
    gate.py      the Gate: one per opened model
"""

from .gate import Gate
from .plans import UNREADABLE, Answer, Grant, Outcome, Place, Plan, Present, Refused, Step, StepKind, next_step, run
from .reporter import Reporter
from .spans import Run, Served

__all__ = [
    "UNREADABLE",
    "Answer",
    "Gate",
    "Grant",
    "Outcome",
    "Place",
    "Plan",
    "Present",
    "Refused",
    "Reporter",
    "Run",
    "Served",
    "Step",
    "StepKind",
    "next_step",
    "run",
]
