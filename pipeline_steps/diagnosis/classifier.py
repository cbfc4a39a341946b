"""The rules engine: log lines of every node + exit code + Batch status reason -> a Diagnosis.

Each line is matched against the rules of rules.toml; a line takes its best rule (lowest tier, then
file order). The best tier found among all lines decides, so a root cause ("cause") always beats what
the other ranks report after it ("symptom"), and a bare family name ("generic": an exception class,
an errno's text) beats only symptoms; within that tier the earliest line wins: by its time
(CloudWatch's event time, or a timestamp at the start of the line), else by node order and line order. Only generic lines or
symptoms matched: the exit code's class from [exit_codes] when it has one (a signal's code only when
the status reason does not say the job was stopped from outside, external_stop), else the log
model's class when it is confident (log_model.py), else that line's class; nothing matched: the
exit code's class, else the log model's, else `unknown`.
"""

from __future__ import annotations

import functools
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from importlib import resources
from pathlib import Path
from typing import Literal

from .log_model import Guess, LogModel, load_model
from .prefilter import lowered, may_match, required_literals

TIERS = ("cause", "likely", "generic", "symptom")
GENERIC = TIERS.index("generic")
WEAK_TIERS = frozenset({GENERIC, TIERS.index("symptom")})
"""Tiers that say less than the step's own exit code, and than a confident log model."""
STEP_RETRYABLE = 75
"""The steps' own exit code for a transient failure: pipeline_contract.ExitCode.RETRYABLE, written
here because the classifier function ships this package alone (a test keeps them equal)."""
SIGNAL_EXIT_CODES = 128
"""Exit codes above this are 128 + a signal number (137: SIGKILL)."""
UNKNOWN = "unknown"
DecidedBy = Literal["rule", "exit code", "log model", "nothing"]
STATUS_REASON = "status reason"
"""The node name of the Batch status reason, classified as one more line."""
MAX_EVIDENCE = 5
_SCAN_CHARS = 2000  # a line longer than this is matched on its first 2000 characters
_SHOWN_CHARS = 300
# A Python traceback's frame and the source line it quotes (indented, unlike the exception's line),
# after a rank's prefix such as "[rank0]:" or "0:".
_RANK_PREFIX = r"^(?:\[rank\d+\]:|\d+:)?"
_FRAME = re.compile(_RANK_PREFIX + r'\s*File "[^"]+", line \d+')
_QUOTED_SOURCE = re.compile(_RANK_PREFIX + r"\s+\S")
_RULES_FILE = "rules.toml"
_RULE_KEYS = {"id", "class", "tier", "patterns", "unless", "retryable", "suggestion", "docs"}
_CLASS_KEYS = {"retryable", "summary", "suggestion", "docs"}


# ---- the rules file -------------------------------------------------------------------------------
@dataclass(frozen=True)
class FailureClass:
    name: str
    retryable: bool
    summary: str
    suggestion: str
    docs: str


@dataclass(frozen=True)
class Rule:
    id: str
    cls: str
    tier: int
    """Index into TIERS: 0 = cause."""
    pattern: re.Pattern[str]
    retryable: bool | None = None
    suggestion: str | None = None
    docs: str | None = None
    literals: tuple[str, ...] | None = None
    """Lower-case strings one of which every match contains (prefilter.py); None: always search."""
    unless: re.Pattern[str] | None = None
    """A line this also matches is not the rule's (a NaN the trainer says it skipped is no cause)."""

    def takes(self, text: str, lowered_line: str) -> bool:
        return (may_match(self.literals, lowered_line) and self.pattern.search(text) is not None
                and not (self.unless is not None and self.unless.search(text)))


@dataclass(frozen=True)
class Rules:
    classes: Mapping[str, FailureClass]
    rules: tuple[Rule, ...]
    exit_codes: Mapping[int, str]
    ignore: re.Pattern[str] | None
    unknown_evidence: re.Pattern[str]
    external_stop: re.Pattern[str] | None

    def best_rule(self, text: str) -> Rule | None:
        """The rule a line takes: the lowest tier, then the first in the file. A generic rule (a bare
        exception name) only when no other rule names the line: an exception class another rule
        knows, even as a symptom, is that rule's. A rule is searched only on a line holding one of
        the strings its every match needs (most lines hold none)."""
        if self.ignore is not None and self.ignore.search(text):
            return None
        line = lowered(text)
        found = [r for r in self.rules if r.takes(text, line)]
        named = [r for r in found if r.tier != GENERIC]
        return min(named or found, key=lambda r: r.tier) if found else None

    def without_prefilter(self) -> Rules:
        """The same rules, every one searched on every line (the prefilter's test and benchmark)."""
        return replace(self, rules=tuple(replace(rule, literals=None) for rule in self.rules))


def _compile(patterns: Sequence[str], where: str) -> re.Pattern[str]:
    if not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise ValueError(f"{where}: patterns must be a non-empty list of non-empty strings")
    try:
        return re.compile("|".join(f"(?:{p})" for p in patterns), re.IGNORECASE)
    except re.error as exc:
        raise ValueError(f"{where}: invalid regular expression ({exc})") from None


def _failure_class(name: str, entry: object, where: str) -> FailureClass:
    if not isinstance(entry, dict) or set(entry) != _CLASS_KEYS:
        raise ValueError(f"{where}: [classes.{name}] needs exactly the keys {sorted(_CLASS_KEYS)}")
    if not isinstance(entry["retryable"], bool):
        raise ValueError(f"{where}: [classes.{name}] retryable must be true or false")
    return FailureClass(name, entry["retryable"], entry["summary"], entry["suggestion"], entry["docs"])


def _rule(entry: object, classes: Mapping[str, FailureClass], where: str) -> Rule:
    if not isinstance(entry, dict) or not {"id", "class", "tier", "patterns"} <= set(entry) <= _RULE_KEYS:
        raise ValueError(f"{where}: every [[rules]] entry needs id, class, tier and patterns "
                         f"(optional: unless, retryable, suggestion, docs); got {sorted(entry) if isinstance(entry, dict) else entry}")
    at = f"{where}: rule {entry['id']!r}"
    if entry["class"] not in classes or entry["class"] == UNKNOWN:
        raise ValueError(f"{at}: class {entry['class']!r} is not one of the [classes] (and not {UNKNOWN!r})")
    if entry["tier"] not in TIERS:
        raise ValueError(f"{at}: tier {entry['tier']!r} is not one of {TIERS}")
    if "retryable" in entry and not isinstance(entry["retryable"], bool):
        raise ValueError(f"{at}: retryable must be true or false")
    pattern = _compile(entry["patterns"], at)
    unless = _compile(entry["unless"], f"{at} unless") if "unless" in entry else None
    return Rule(entry["id"], entry["class"], TIERS.index(entry["tier"]), pattern, entry.get("retryable"),
                entry.get("suggestion"), entry.get("docs"), required_literals(pattern.pattern), unless)


def parse_rules(text: str, where: str = _RULES_FILE) -> Rules:
    """Rules from the TOML text; a ValueError names the file, the rule and what is wrong."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{where}: not valid TOML ({exc})") from None
    classes = {name: _failure_class(name, entry, where) for name, entry in data.get("classes", {}).items()}
    if UNKNOWN not in classes:
        raise ValueError(f"{where}: [classes.{UNKNOWN}] is missing (what an unrecognised failure says)")
    rules = tuple(_rule(entry, classes, where) for entry in data.get("rules", []))
    ids = [r.id for r in rules]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{where}: duplicate rule ids {sorted({i for i in ids if ids.count(i) > 1})}")
    exit_codes = {}
    for code, name in data.get("exit_codes", {}).items():
        if not code.isdigit() or name not in classes:
            raise ValueError(f"{where}: [exit_codes] {code} = {name!r}: a number and one of the [classes]")
        exit_codes[int(code)] = name
    ignore = data.get("ignore", [])
    return Rules(classes=classes, rules=rules, exit_codes=exit_codes,
                 ignore=_compile(ignore, f"{where}: ignore") if ignore else None,
                 unknown_evidence=_compile([data.get("unknown_evidence", "error")], f"{where}: unknown_evidence"),
                 external_stop=_compile(data["external_stop"], f"{where}: external_stop") if "external_stop" in data
                 else None)


@functools.cache
def _packaged_rules() -> Rules:
    return parse_rules(resources.files(__package__).joinpath(_RULES_FILE).read_text(encoding="utf-8"))


def load_rules(path: str | Path | None = None) -> Rules:
    """The reviewed rules shipped with the package, or another rules file (same format)."""
    if path is None:
        return _packaged_rules()
    return parse_rules(Path(path).read_text(encoding="utf-8"), str(path))


# ---- logs and their times -------------------------------------------------------------------------
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
# ISO 8601 (Python logging, torch, neuronx-cc) and the Neuron runtime's "2024-Oct-15 18:01:17.7287".
_ISO = re.compile(r"(\d{4})-(\d\d)-(\d\d)[T ](\d\d):(\d\d):(\d\d)(?:[.,](\d{1,9}))?(Z|[+-]\d\d:?\d\d)?")
_NEURON = re.compile(r"(\d{4})-(" + "|".join(_MONTHS) + r")-(\d\d) (\d\d):(\d\d):(\d\d)(?:\.(\d{1,9}))?")
_TIME_PREFIX_CHARS = 80  # a timestamp counts only near the start of the line (not one inside a message)


def line_time(text: str) -> float | None:
    """Epoch seconds of a timestamp at the start of the line (UTC when it has no zone), else None."""
    head = text[:_TIME_PREFIX_CHARS]
    match = _ISO.search(head)
    month = None
    if match:
        month = int(match.group(2))
    else:
        match = _NEURON.search(head)
        if match:
            month = _MONTHS.index(match.group(2)) + 1
    if not match or month is None:
        return None
    year, day, hour, minute, second = (int(match.group(i)) for i in (1, 3, 4, 5, 6))
    try:
        moment = datetime(year, month, day, hour, minute, second, tzinfo=UTC)
    except ValueError:
        return None
    seconds = moment.timestamp() + float("0." + (match.group(7) or "0"))
    zone = match.group(8) if match.re is _ISO else None
    if zone and zone != "Z":
        sign = 1 if zone[0] == "+" else -1
        seconds -= sign * (int(zone[1:3]) * 3600 + int(zone[-2:]) * 60)
    return seconds


@dataclass(frozen=True)
class NodeLog:
    """The tail of one node's log: its lines and, when known, each line's time (epoch seconds)."""

    node: str
    lines: tuple[str, ...]
    times: tuple[float | None, ...] | None = None

    @classmethod
    def from_text(cls, node: str, text: str) -> NodeLog:
        return cls(node, tuple(text.splitlines()))

    def line_times(self) -> list[float | None]:
        """Each line's time: given, else parsed from the line; a line without one (a traceback
        frame, a continuation) takes the time of the line before it."""
        times, last = [], None
        for i, text in enumerate(self.lines):
            given = self.times[i] if self.times is not None and i < len(self.times) else None
            last = given if given is not None else (line_time(text) or last)
            times.append(last)
        return times


# ---- the diagnosis --------------------------------------------------------------------------------
def _iso(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass(frozen=True)
class Evidence:
    node: str
    line: int
    """1-based line number in that node's log (the tail that was read)."""
    text: str
    rule: str | None
    time: float | None = None

    def as_dict(self) -> dict:
        return {"node": self.node, "line": self.line, "text": self.text, "rule": self.rule,
                "timestamp": _iso(self.time)}


@dataclass(frozen=True)
class Diagnosis:
    cls: str
    retryable: bool
    evidence: tuple[Evidence, ...]
    suggestion: str
    docs: str
    summary: str
    node: str | None
    """The node of the deciding line: where the first error appeared."""
    decided_by: DecidedBy = "rule"
    probability: float | None = None
    """The log model's probability of the class, when the model decided."""
    model_note: str | None = None
    """What the log model did: decided (and how sure it was), or doubted a bare family name."""

    def as_dict(self) -> dict:
        return {"class": self.cls, "retryable": self.retryable, "evidence": [e.as_dict() for e in self.evidence],
                "suggestion": self.suggestion, "docs": self.docs, "summary": self.summary, "node": self.node,
                "decided_by": self.decided_by,
                "probability": None if self.probability is None else round(self.probability, 3),
                "model_note": self.model_note}

    @property
    def retry(self) -> str:
        return "a retry can help" if self.retryable else "a retry will not help"

    def evidence_lines(self) -> list[str]:
        return [f"[{e.node} line {e.line}] {e.text}" for e in self.evidence]

    def text(self) -> str:
        """The human form: what `diagnose` prints and the failure notification carries."""
        lines = [f"Class: {self.cls} ({self.retry}). {self.summary}"]
        if self.model_note:
            lines.append(f"Decided by: {self.model_note}")
        if self.node is not None:
            lines.append(f"First error on: {self.node}")
        if self.evidence:
            lines.append("Evidence:")
            lines += [f"  {line}" for line in self.evidence_lines()]
        lines += [f"Suggestion: {self.suggestion}", f"Docs: {self.docs}"]
        return "\n".join(lines)


@dataclass(frozen=True)
class _Match:
    rule: Rule | None
    """None: a line that only looks like an error (evidence when nothing decides)."""
    evidence: Evidence
    order: tuple[int, int]  # (node index, line index)

    def key(self) -> tuple:
        # The best tier first; in it, timed lines by time, then node and line order.
        t = self.evidence.time
        return (len(TIERS) if self.rule is None else self.rule.tier, t is None, t or 0.0, self.order)


def _shown(text: str) -> str:
    text = text.strip()
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS - 3] + "..."


def _scan(sources: Sequence[NodeLog], rules: Rules) -> list[_Match]:
    """Every line that takes a rule or looks like an error, but the source line a Python traceback
    quotes under a frame: `raise RuntimeError(f"neuronx-cc failed with {status}")` is code, not
    what happened."""
    found = []
    for n, source in enumerate(sources):
        after_frame = False
        for i, (text, t) in enumerate(zip(source.lines, source.line_times())):
            frame = _FRAME.match(text) is not None
            quoted = after_frame and not frame and _QUOTED_SOURCE.match(text) is not None
            after_frame = frame
            if quoted:
                continue
            scanned = text[:_SCAN_CHARS]
            rule = rules.best_rule(scanned)
            if rule is not None or rules.unknown_evidence.search(scanned):
                rule_id = rule.id if rule is not None else None
                found.append(_Match(rule, Evidence(source.node, i + 1, _shown(text), rule_id, t), (n, i)))
    return found


def _evidence(decisive: _Match, matches: list[_Match]) -> tuple[Evidence, ...]:
    """The deciding line, then other lines of its class (one per distinct text and node)."""
    assert decisive.rule is not None  # a line is decisive by its rule
    shown, seen = [decisive.evidence], {(decisive.evidence.node, decisive.evidence.text)}
    for m in sorted(matches, key=_Match.key):
        key = (m.evidence.node, m.evidence.text)
        if m.rule is not None and m.rule.cls == decisive.rule.cls and key not in seen and len(shown) < MAX_EVIDENCE:
            shown.append(m.evidence)
            seen.add(key)
    return tuple(shown)


def _from_class(rules: Rules, name: str, evidence: tuple[Evidence, ...], node: str | None, *,
                exit_code: int | None, rule: Rule | None = None, decided_by: DecidedBy = "rule",
                probability: float | None = None, model_note: str | None = None) -> Diagnosis:
    info = rules.classes[name]
    retryable = info.retryable
    if rule is not None and rule.retryable is not None:
        retryable = rule.retryable
    if name == UNKNOWN:
        retryable = exit_code == STEP_RETRYABLE  # the step said so
    return Diagnosis(name, retryable, evidence, (rule and rule.suggestion) or info.suggestion,
                     (rule and rule.docs) or info.docs, info.summary, node, decided_by, probability, model_note)


def _exit_code_class(rules: Rules, exit_code: int | None, status_reason: str | None) -> str | None:
    """The class [exit_codes] gives the exit code; none for a signal's code when Batch says the
    job was stopped from outside (a timeout, an operator): the signal then names no cause."""
    if exit_code is None:
        return None
    return None if _stopped(rules, status_reason) and exit_code > SIGNAL_EXIT_CODES else rules.exit_codes.get(exit_code)


def _stopped(rules: Rules, status_reason: str | None) -> bool:
    """Batch says the job was stopped from outside (a timeout, an operator): no failure of its own."""
    return bool(status_reason and rules.external_stop and rules.external_stop.search(status_reason))


def _earliest(found: list[_Match]) -> str | None:
    """The node of the earliest line that looks like an error: by time, else node and line order."""
    if not found:
        return None
    return min(found, key=lambda m: (m.evidence.time is None, m.evidence.time or 0.0, m.order)).evidence.node


def _from_guess(rules: Rules, guess: Guess, sources: Sequence[NodeLog], found: list[_Match],
                exit_code: int | None) -> Diagnosis:
    times = {(s.node, i + 1): t for s in sources for i, t in enumerate(s.line_times())}
    evidence = tuple(Evidence(line.node, line.number, _shown(line.text), None, times.get((line.node, line.number)))
                     for line in guess.lines)
    note = f"the log model, probability {guess.probability:.2f} (no rule named the cause; check the evidence)"
    return _from_class(rules, guess.cls, evidence, _earliest(found), exit_code=exit_code, decided_by="log model",
                       probability=guess.probability, model_note=note)


def classify(logs: Sequence[NodeLog], *, exit_code: int | None = None, status_reason: str | None = None,
             rules: Rules | None = None, model: LogModel | None | Literal["packaged"] = "packaged") -> Diagnosis:
    """The failure class of a job from the tails of its nodes' logs (in node order, main node
    first), its exit code and Batch's status reason. `model`: the log model for what no rule
    names (None: rules only)."""
    rules = rules or load_rules()
    sources = list(logs)
    if status_reason:
        sources.append(NodeLog(STATUS_REASON, (" ".join(status_reason.split()),)))
    found = _scan(sources, rules)
    by_exit_code = _exit_code_class(rules, exit_code, status_reason)
    first = min(found, key=_Match.key) if found else None
    rule = first.rule if first is not None else None
    doubt = None
    # No rule, or only a weak one (a symptom, a bare family name): a confident log model decides,
    # and a model that leans elsewhere leaves a bare family name's class unsaid (unknown). It reads only a
    # log with a line that looks like an error (unknown_evidence; a healthy log's warnings are no
    # failure), and never against the step's own exit 75 (retryable) nor for a job Batch stopped from outside.
    if (found and (rule is None or rule.tier in WEAK_TIERS) and by_exit_code is None and model is not None
            and exit_code != STEP_RETRYABLE and not _stopped(rules, status_reason)):
        log_model = load_model() if model == "packaged" else model
        guess = log_model.guess([(s.node, s.lines) for s in sources])
        if guess is not None and guess.cls in rules.classes and not (rule is not None and guess.cls == rule.cls):
            if guess.probability >= log_model.min_probability:
                return _from_guess(rules, guess, sources, found, exit_code)
            if rule is not None and rule.tier == GENERIC and guess.probability >= log_model.doubt_probability:
                doubt = (f"nothing: the rules saw only a bare family name ({rule.cls}, rule {rule.id}) and the log model leans "
                         f"to {guess.cls} (probability {guess.probability:.2f})")
                rule = None
    # A symptom (a peer went away) or a generic exception name says less than the step's own exit code.
    if first is not None and rule is not None and not (rule.tier in WEAK_TIERS and by_exit_code):
        return _from_class(rules, rule.cls, _evidence(first, found), first.evidence.node, exit_code=exit_code,
                           rule=rule)
    recent = [m.evidence for m in sorted(found, key=lambda m: m.order)][-MAX_EVIDENCE:]
    return _from_class(rules, by_exit_code or UNKNOWN, tuple(recent), _earliest(found), exit_code=exit_code,
                       decided_by="exit code" if by_exit_code else "nothing", model_note=doubt)
