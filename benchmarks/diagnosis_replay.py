"""How the failure classifier does on logs it has not seen, and how fast it reads a wide job.

    python -m benchmarks.diagnosis_replay                     # replay every holdout set of the corpus
    python -m benchmarks.diagnosis_replay --score NEW.toml    # score a new set (corpus format) once
    python -m benchmarks.diagnosis_replay --bars 0.3,0.4,0.6  # the replay with the model's bar at each value too
    python -m benchmarks.diagnosis_replay --speed             # a 100-node job's classification time

Replay: each holdout set scored with the rules.toml of its day (from git) and a log model fit on the
sets before it: rules alone, rules + model as shipped, without its doubt bar, always answering (and
at each --bars value: the trade between right and wrong answers the shipped bar chooses from).
Score: today's rules and model on new cases, before they join the corpus. Speed: a 100-node job's
tails with the rules' prefilter and without it. Method and figures: docs/operations.md.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from pipeline_steps.diagnosis import UNKNOWN, NodeLog, Rules, classify, load_rules
from pipeline_steps.diagnosis.classifier import parse_rules
from pipeline_steps.diagnosis.log_model import LogModel, load_model
from scripts.failure_model import CORPUS, REPO, corpus_files, diagnose_case, fit, load_cases

RULES_PATH = "pipeline_steps/diagnosis/rules.toml"
OUTCOMES = ("right", "wrong", "unknown")


def split_rank(split: str) -> int:
    """dev and project (this project's own messages), then holdout, holdout2, ...: the order the sets came in."""
    if split in ("dev", "project"):
        return 0
    match = re.fullmatch(r"holdout(\d*)", split)
    if match is None:
        raise ValueError(f"unknown split {split!r}")
    return int(match.group(1) or 1)


def added_in(split: str) -> str:
    """The commit that added `split`'s cases to the corpus."""
    added = subprocess.run(
        [
            "git",
            "-C",
            str(REPO),
            "log",
            "--reverse",
            "--format=%H",
            "-S",
            f'split = "{split}"',
            "--",
            str(CORPUS.relative_to(REPO)),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    if not added.stdout.strip():
        raise SystemExit(
            f"no commit adds the {split} cases: the replay needs the repository's history "
            "(in a shallow clone: git fetch --unshallow)"
        )
    return added.stdout.split()[0]


def depth(commit: str) -> int:
    """How many commits lead to `commit`: the order the sets came in."""
    count = subprocess.run(["git", "-C", str(REPO), "rev-list", "--count", commit], capture_output=True, text=True,
                           check=True)
    return int(count.stdout)


def rules_before(commit: str) -> Rules | None:
    """rules.toml as it was just before `commit` (the one that added a set's cases); None for the sets
    that came with the first rules (no rules of their day to replay)."""
    before = subprocess.run(["git", "-C", str(REPO), "show", f"{commit}^:{RULES_PATH}"], capture_output=True, text=True)
    if before.returncode != 0:
        return None
    # the rules of that day, with today's notion of a line that looks like an error (the model's gate)
    return replace(
        parse_rules(before.stdout, f"{RULES_PATH} at {commit[:10]}^"), unknown_evidence=load_rules().unknown_evidence
    )


def outcome(case: dict[str, Any], rules: Rules, model: LogModel | None) -> str:
    got = diagnose_case(case, rules=rules, model=model).cls
    return "right" if got == case["class"] else "unknown" if got == UNKNOWN else "wrong"


WAYS = ("rules (first score)", "rules + model (ships)", "without the doubt bar", "rules + model always")


def _ways(bars: Sequence[float]) -> tuple[str, ...]:
    return (*WAYS, *(f"model bar {bar}" for bar in bars))


def score(
    cases: Sequence[dict[str, Any]], rules: Rules, model: LogModel, bars: Sequence[float] = ()
) -> dict[str, Counter[str]]:
    """Right / wrong / unknown counts of each way of answering (WAYS, then the model at each bar)."""
    models = (
        None,
        model,
        replace(model, doubt_probability=1.01),
        replace(model, min_probability=0.0),
        *(replace(model, min_probability=bar) for bar in bars),
    )
    return {way: Counter(outcome(case, rules, m) for case in cases) for way, m in zip(_ways(bars), models)}


def _row(name: str, cases: int, scores: dict[str, Counter[str]]) -> str:
    cells = [
        f"{s['right']:3} ({s['right'] / cases:4.0%}) / {s['wrong']:2} ({s['wrong'] / cases:4.0%})"
        for s in scores.values()
    ]
    return f"{name:10} {cases:5}  " + "  ".join(f"{c:24}" for c in cells)


def _header(bars: Sequence[float] = ()) -> str:
    return f"{'set':10} {'cases':5}  " + "  ".join(f"{w + ': right / wrong':24}" for w in _ways(bars))


def replay(bars: Sequence[float] = ()) -> None:
    cases = load_cases(corpus_files())
    splits = sorted({c["split"] for c in cases if c["split"].startswith("holdout")}, key=split_rank)
    total: dict[str, Counter[str]] = {}
    print(_header(bars))
    added = {split: added_in(split) for split in splits}
    came = {split: depth(commit) for split, commit in added.items()}
    models: dict[int, LogModel] = {}  # one fit per commit: its sets share the model they were scored with
    for split in splits:
        rules = rules_before(added[split])
        if rules is None:
            print(f"{split:10} (came with the first rules: none of its day to replay)")
            continue
        # the model knows the sets that came before this one; sets that came in one commit were scored
        # with the same model and do not see each other
        if came[split] not in models:
            models[came[split]] = LogModel.from_dict(fit([c for c in cases if came.get(c["split"], 0) < came[split]]))
        model = models[came[split]]
        scores = score([c for c in cases if c["split"] == split], rules, model, bars)
        print(_row(split, sum(scores[WAYS[0]].values()), scores), flush=True)
        total = {way: total.get(way, Counter()) + s for way, s in scores.items()}
    print(_row("all", sum(total[WAYS[0]].values()), total))


def speed(nodes: int = 100, lines: int = 500) -> None:
    """Seconds to classify a wide job's tails with and without the rules' prefilter, and their ratio."""
    healthy = (CORPUS / "healthy.log").read_text("utf-8").splitlines()
    tail = tuple((healthy * (lines // len(healthy) + 1))[:lines])
    (failing,) = [c for c in load_cases(corpus_files()) if c["id"] == "ronin-51-checkpoint-cannot-be-opened"]
    logs = [NodeLog(f"node-{i}", tail) for i in range(nodes - 1)]
    logs.append(NodeLog(f"node-{nodes - 1}", tail[: lines - 2] + tuple(failing["log"].splitlines())))
    rules = load_rules()
    unfiltered = rules.without_prefilter()
    seconds = {}
    for name, these in (("prefiltered", rules), ("every rule on every line", unfiltered)):
        start = time.perf_counter()
        got = classify(logs, rules=these).cls
        seconds[name] = time.perf_counter() - start
        print(f"{nodes} nodes x {lines} lines, {name}: {seconds[name]:.1f} s ({got})", flush=True)
    print(
        f"speed-up: {seconds['every rule on every line'] / seconds['prefiltered']:.1f}x "
        f"(load average {os.getloadavg()[0]:.2f})"
    )


def _bars(text: str) -> tuple[float, ...]:
    try:
        bars = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give probabilities separated by commas, e.g. 0.3,0.4") from None
    if not all(0.0 <= bar <= 1.0 for bar in bars):
        raise argparse.ArgumentTypeError(f"{text!r}: each bar is a probability from 0 to 1")
    return bars


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--score", type=Path, metavar="FILE", help="score the cases of FILE (corpus format) once")
    parser.add_argument("--speed", action="store_true", help="time a 100-node job's classification")
    parser.add_argument("--bars", type=_bars, default=(), metavar="P,P,...",
                        help="also score with the model's probability bar at each value (0 to 1)")
    args = parser.parse_args(argv)
    if args.speed:
        speed()
        return 0
    if args.score is None:
        replay(args.bars)
        return 0
    cases = load_cases([args.score])
    print(_header(args.bars))
    print(_row(args.score.stem, len(cases), score(cases, load_rules(), load_model(), args.bars)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
