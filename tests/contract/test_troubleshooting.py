"""docs/troubleshooting.md lists every user-facing error and warning message with its fix.

The messages are collected from the source with ``ast``: the message of every
``raise SomeError(<message>)`` and the first argument of every ``log.warning``/``log.error``/
``warnings.warn`` call in the modules users meet, where the message is a string constant, an
f-string, a concatenation, or a name bound to a module-level string constant.  Each message's
static lead (its text up to the first placeholder, without the ``dcredit_hvd: `` prefix) must be
quoted in the troubleshooting page; a lead too short to identify the message is replaced by the
message's longest static fragment.  Adding an error without documenting it fails here, naming the
message and where it is raised.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "dcredit_hvd"
DOC = ROOT / "docs" / "troubleshooting.md"

#: The modules whose messages reach users (construction, training, the command line, and the
#: cost-model fit run while ``dcredit`` profiles or when ``plan``/``simulate`` read a profile).
USER_FACING = ("*.py", "runtime/*.py", "policies/*.py", "planning/blocks.py",
               "planning/costmodel.py", "liveness/*.py", "transports/*.py")

#: (file, exception, start of the message or None for any): why it is not documented.
SKIPPED = {
    ("runtime/scheduler.py", "AssertionError", "enqueue outside an iteration"):
        "internal invariant of BlockScheduler; the optimizer always opens an iteration first",
    ("runtime/amplifier.py", "ValueError", "race amplifier: max_seconds"):
        "internal invariant: config.py refuses a negative race_amplifier first (documented there)",
    ("runtime/timeline.py", "ValueError", "layer kind must be"):
        "internal invariant: the runtime records only forward and backward layers",
    ("__init__.py", "AttributeError", None):
        "Python's standard message for a missing module attribute (the lazy __getattr__)",
}

#: A lead shorter than this is not specific enough; the longest static fragment is used instead.
MIN_LEAD = 12

_LOG_METHODS = {"warning", "error", "exception", "critical"}
_LOGGERS = {"log", "logger", "logging"}
#: A %-format directive, as logging applies it to its message.
_PERCENT = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(?:\*|\d+)?(?:\.(?:\*|\d+))?[diouxXeEfFgGcrsa%]")
#: A str.format placeholder.
_BRACES = re.compile(r"\{[^{}]*\}")

Parts = list[Optional[str]]  # static text, None for a placeholder


@dataclass(frozen=True)
class Message:
    file: str          # relative to the package
    line: int
    kind: str          # the exception raised, or the logging/warnings call
    parts: tuple

    @property
    def where(self) -> str:
        return f"dcredit_hvd/{self.file}:{self.line}"

    @property
    def text(self) -> str:
        """As printed, with ``…`` for each value filled in at run time."""
        return "".join("…" if p is None else p for p in self.parts)

    @property
    def lead(self) -> str:
        static = []
        for part in self.parts:
            if part is None:
                break
            static.append(part)
        return _strip_prefix(_normalise("".join(static)))

    @property
    def fragment(self) -> str:
        """What the troubleshooting page must quote to identify this message."""
        if len(self.lead) >= MIN_LEAD:
            return self.lead
        fragments = [_strip_prefix(_normalise(p)).lstrip(".,;: ") for p in self.parts if p is not None]
        return max(fragments, key=len, default="")

    def skipped(self) -> Optional[str]:
        for (file, kind, start), reason in SKIPPED.items():
            if self.file == file and self.kind == kind and (start is None or self.lead.startswith(start)):
                return reason
        return None


def _normalise(text: str) -> str:
    return " ".join(text.split())


def _strip_prefix(text: str) -> str:
    return text[len("dcredit_hvd:"):].lstrip() if text.startswith("dcredit_hvd:") else text


def _split(text: str, pattern: re.Pattern, literal: dict) -> Parts:
    parts: Parts = []
    last = 0
    for match in pattern.finditer(text):
        parts.append(text[last:match.start()])
        parts.append(literal.get(match.group()))
        last = match.end()
    parts.append(text[last:])
    return parts


def _merge(parts: Parts) -> tuple:
    merged: Parts = []
    for part in parts:
        if part is not None and merged and merged[-1] is not None:
            merged[-1] += part
        elif part != "":
            merged.append(part)
    return tuple(merged)


class _Resolver:
    """Turns a message expression into static text and placeholders, or None if it is not one
    of the recognised forms."""

    def __init__(self, tree: ast.Module):
        self.constants: dict[str, ast.expr] = {}
        for node in tree.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target, value = node.targets[0], node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                target, value = node.target, node.value
            else:
                continue
            if isinstance(target, ast.Name):
                self.constants[target.id] = value

    def parts(self, node: ast.expr, percent: bool, depth: int = 0) -> Optional[Parts]:
        if depth > 20:
            return None
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return _split(node.value, _PERCENT, {"%%": "%"}) if percent else [node.value]
        if isinstance(node, ast.JoinedStr):
            parts: Parts = []
            for value in node.values:
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    parts.append(value.value)
                else:
                    parts.append(None)
            return parts
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left = self.parts(node.left, percent, depth + 1)
            right = self.parts(node.right, percent, depth + 1)
            return None if left is None or right is None else left + right
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
            return self.parts(node.left, True, depth + 1)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "format"):
            template = self.parts(node.func.value, False, depth + 1)
            if template is None:
                return None
            parts = []
            for part in template:
                parts.extend([None] if part is None else
                             _split(part, _BRACES, {}))
            return [p.replace("{{", "{").replace("}}", "}") if p else p for p in parts]
        if isinstance(node, ast.Name) and node.id in self.constants:
            return self.parts(self.constants[node.id], percent, depth + 1)
        return None


def _call_name(func: ast.expr) -> str:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return ast.unparse(func)


def _messages_in(source: str, file: str) -> list[Message]:
    tree = ast.parse(source)
    resolve = _Resolver(tree)
    found = []
    for node in ast.walk(tree):
        call, percent = None, False
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            call, kind = node.exc, _call_name(node.exc.func)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if (node.func.attr in _LOG_METHODS and isinstance(owner, ast.Name)
                    and owner.id in _LOGGERS):
                call, kind, percent = node, f"log.{node.func.attr}", True
            elif node.func.attr == "warn" and isinstance(owner, ast.Name) and owner.id == "warnings":
                call, kind = node, "warnings.warn"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "warn":
            call, kind = node, "warnings.warn"
        if call is None or not call.args:
            continue
        parts = resolve.parts(call.args[0], percent)
        if parts is None:
            continue
        found.append(Message(file, call.lineno, kind, _merge(parts)))
    return sorted(found, key=lambda m: m.line)


def collect() -> list[Message]:
    messages = []
    for pattern in USER_FACING:
        for path in sorted(PACKAGE.glob(pattern)):
            file = path.relative_to(PACKAGE).as_posix()
            messages.extend(_messages_in(path.read_text(encoding="utf-8"), file))
    return messages


def _searchable(text: str) -> str:
    """Markdown quotes messages in backticks; a message's own backticks are dropped likewise."""
    return _normalise(text.replace("`", ""))


def _doc_text() -> str:
    return _searchable(DOC.read_text(encoding="utf-8"))


ALL = collect()
DOCUMENTED = [m for m in ALL if m.skipped() is None]


@pytest.mark.parametrize("message", DOCUMENTED, ids=[m.where for m in DOCUMENTED])
def test_every_user_facing_error_message_is_listed_in_troubleshooting(message: Message):
    listed = _searchable(message.fragment) in _doc_text()
    assert listed, (
        f"{message.where}: {message.kind}({message.text!r}) is not in docs/troubleshooting.md; "
        f"add a row quoting {message.fragment!r} with its cause and fix")


def test_the_collector_finds_the_messages_users_can_meet():
    assert len(DOCUMENTED) >= 40, [m.where for m in DOCUMENTED]
    assert {m.kind for m in DOCUMENTED} >= {"ValueError", "TypeError", "log.warning", "log.error",
                                            "warnings.warn"}
    assert all(len(m.fragment) >= 8 for m in DOCUMENTED), [
        (m.where, m.fragment) for m in DOCUMENTED if len(m.fragment) < 8]


def test_every_skip_entry_still_matches_a_message():
    for key, reason in SKIPPED.items():
        file, kind, start = key
        assert any(m.skipped() == reason and m.file == file for m in ALL), (
            f"SKIPPED entry {key} matches no message any more: remove it")


SAMPLE = '''
import logging, warnings
log = logging.getLogger("x")
_CONSTANT = (
    "dcredit_hvd: the first half of a message "
    "and its second half."
)
_JOINED = "joined " + "by plus"

def f(value, exc):
    raise ValueError(_CONSTANT)
    raise TypeError(f"dcredit_hvd: {value} is the wrong kind of thing, got {value!r}")
    raise RuntimeError("concatenated " + f"with an f-string {value}")
    raise ValueError(_JOINED)
    raise type(exc)(f"wrapped again: {exc}")
    raise ValueError("%d percent of the time" % value)
    raise ValueError("{} of {} via format".format(value, value))
    raise ValueError(value)
    log.warning("dcredit_hvd: %d block(s) still outstanding after %.0f s", 1, 2.0)
    log.error("100%% sure that it failed: %s", exc)
    warnings.warn("a deprecation in a warning call", DeprecationWarning)
'''


def test_the_collector_resolves_constants_fstrings_concatenations_and_log_formats():
    got = {(m.kind, m.lead, m.fragment) for m in _messages_in(SAMPLE, "sample.py")}
    assert got == {
        ("ValueError", "the first half of a message and its second half.",
         "the first half of a message and its second half."),
        ("TypeError", "", "is the wrong kind of thing, got"),
        ("RuntimeError", "concatenated with an f-string", "concatenated with an f-string"),
        ("ValueError", "joined by plus", "joined by plus"),
        ("type(exc)", "wrapped again:", "wrapped again:"),
        ("ValueError", "", "percent of the time"),
        ("ValueError", "", "via format"),
        ("log.warning", "", "block(s) still outstanding after"),
        ("log.error", "100% sure that it failed:", "100% sure that it failed:"),
        ("warnings.warn", "a deprecation in a warning call", "a deprecation in a warning call"),
    }
