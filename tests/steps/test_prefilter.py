"""The rules' prefilter: the strings a pattern's every match contains, so a line without them skips
the search; it must never change which rule a line takes."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline_steps.diagnosis import load_rules
from pipeline_steps.diagnosis.prefilter import lowered, may_match, required_literals
from scripts.failure_model import CORPUS, case_lines, corpus_files, load_cases

RULES = load_rules()
PATTERNS = [p for rule in tomllib.loads((Path(__file__).parents[2] / "pipeline_steps" / "diagnosis" / "rules.toml")
                                        .read_text("utf-8"))["rules"] for p in rule["patterns"]]


@pytest.mark.parametrize("pattern, literals", [
    ("No space left on device", ("no space left on device",)),
    (r"\b(CUDA|HIP) out of memory", (" out of memory",)),   # the longer of two required parts
    (r"(exit code )?137\b", ("137",)),                      # an optional group is not required
    (r"[A-Z]\w+Error: .*timed out", ("timed out",)),           # the most selective required part
    (r"NRT_(TIMEOUT|COLL_PENDING)", ("coll_pending", "timeout")),  # either branch's: one is in any match
    (r"(Killed|\u5df2\u6740\u6b7b)$", ("killed", "\u5df2\u6740\u6b7b")),  # CJK has no case: usable
    (r"(ab)+c", ("ab",)),
    (r"\d+ GiB", (" gib",)),
    (r"\d+|oom", None),                                      # one branch needs nothing
    (r"(?:x)*", None),
    (r"\u0130stanbul", None),                                # a cased non-ASCII letter: not lower()-safe
])
def test_required_literals(pattern: str, literals: tuple[str, ...] | None) -> None:
    assert required_literals(pattern) == literals


@pytest.mark.parametrize("pattern, text", [
    ("failed", "FA\u0131LED"),                   # dotless i: IGNORECASE matches it to i, lower() does not
    ("No space left on device", "No \u017fpace left on device"),  # long s
])
def test_a_line_ignorecase_matches_passes_the_prefilter(pattern: str, text: str) -> None:
    assert re.search(pattern, text, re.IGNORECASE)
    assert may_match(required_literals(pattern), lowered(text))


def _lines() -> list[str]:
    healthy = (CORPUS / "healthy.log").read_text("utf-8").splitlines()
    return healthy + [line for case in load_cases(corpus_files()) for line in case_lines(case)]


def test_the_prefilter_never_changes_the_rule_a_corpus_line_takes() -> None:
    unfiltered = RULES.without_prefilter()
    lines = _lines()
    assert len(lines) > 1500

    def taken(rules, line):
        rule = rules.best_rule(line)
        return rule.id if rule else None

    assert [taken(RULES, line) for line in lines] == [taken(unfiltered, line) for line in lines]
    assert all(rule.literals for rule in RULES.rules)  # every packaged rule is prefiltered


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), index=st.integers(0, len(PATTERNS) - 1))
def test_any_text_a_rule_pattern_matches_passes_its_prefilter(data: st.DataObject, index: int) -> None:
    """Texts generated from the pattern itself (hypothesis' from_regex), in any letter case."""
    pattern = PATTERNS[index]
    text = data.draw(st.from_regex(re.compile(pattern, re.IGNORECASE)))
    assert re.search(pattern, text, re.IGNORECASE)
    assert may_match(required_literals(pattern), lowered(text)), (pattern, text)
