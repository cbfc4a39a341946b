#!/usr/bin/env python3
"""Fit the failure classifier's log model on the corpus and write pipeline_steps/diagnosis/log_model.json.gz.

    python -m scripts.failure_model            # after adding corpus cases (make failure-model)

The model (pipeline_steps/diagnosis/log_model.py) answers for the failures no rule names. It is fit
with scikit-learn (a dev dependency) and shipped as gzipped JSON numbers, so the classifier Lambda needs no
numpy. The file records the corpus digest: tests/steps/test_log_model.py fails when a corpus case was
added without fitting again. benchmarks/diagnosis_replay.py uses `fit` to replay the holdout sets.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pipeline_steps.diagnosis import Diagnosis, NodeLog, Rules, classify
from pipeline_steps.diagnosis.classifier import STATUS_REASON
from pipeline_steps.diagnosis.log_model import MODEL_FILE, LogModel, normalise

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "tests" / "steps" / "failure_corpus"
OUTPUT = REPO / "pipeline_steps" / "diagnosis" / MODEL_FILE
# What a failure line looks like (broader than the rules' unknown_evidence: the model weighs the
# words, a pattern only picks the lines), and one line of context either side.
LINE_PATTERN = (
    "error|fail|fatal|exception|abort|killed|oom|out of memory|nan|timeout|timed out|refused|"
    "denied|unable|cannot|could not|exceed|insufficient|traceback|raise|invalid|terminat|signal|exit"
)
CONTEXT = 1
NGRAM_RANGE = (3, 5)
MIN_DOCUMENT_FREQUENCY = 2
"""An n-gram seen in one case only is that case's noise (a path, an id), not a family's wording."""
INVERSE_REGULARISATION = 30.0
MIN_PROBABILITY = 0.65
"""Below it the model says unknown. Chosen on the replay of holdouts 4 to 40 (benchmarks/diagnosis_replay.py
--bars): wrong answers fall with the bar up to 0.65 and no further (0.5: 70% right, 7.0% wrong; 0.65: 68%
and 5.4%; 0.7: 67% and 5.4%); the next round (holdouts 41-44) lost 3 right and 8 wrong answers by it."""
DOUBT_PROBABILITY = 0.2
"""A rule of tier generic (a bare family name: ENOMEM's text today; a bare exception name read as user code
in earlier days' rules) stands only when the model gives no other class this much; otherwise the answer
is unknown. The exception-name rule was right about half the time on the holdout sets and is gone; the
rules of earlier days, which the replay runs, have it, and its "without the doubt bar" column shows
what the bar changed (on holdouts 4 to 88, 50 answers from wrong to unknown and 8 from right)."""


def corpus_files(corpus: Path = CORPUS) -> list[Path]:
    return sorted(corpus.glob("*.toml"))


def load_cases(paths: Sequence[Path]) -> list[dict[str, Any]]:
    return [case for path in paths for case in tomllib.loads(path.read_text("utf-8"))["case"]]


def node_logs(case: dict[str, Any]) -> list[NodeLog]:
    """A case's node logs (`log` is one node's, `[case.logs]` one per node), main node first."""
    logs = case["logs"] if "logs" in case else {"main": case.get("log", "")}
    return [NodeLog.from_text(node, text) for node, text in logs.items()]


def diagnose_case(
    case: dict[str, Any], *, rules: Rules | None = None, model: LogModel | None | Literal["packaged"] = "packaged"
) -> Diagnosis:
    """The classifier's answer for a case, as for a job with those logs, exit code and status reason."""
    return classify(
        node_logs(case),
        exit_code=case.get("exit_code"),
        status_reason=case.get("status_reason"),
        rules=rules,
        model=model,
    )


def case_lines(case: dict[str, Any]) -> list[str]:
    """Every line of a case, the status reason's too."""
    return [line for log in node_logs(case) for line in log.lines] + (case.get("status_reason") or "").splitlines()


def case_logs(case: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """A case as the classifier sees a job: each node's lines, then the status reason as one more line."""
    sources = [(log.node, list(log.lines)) for log in node_logs(case)]
    if case.get("status_reason"):
        sources.append((STATUS_REASON, [" ".join(case["status_reason"].split())]))
    return sources


def digest(paths: Sequence[Path]) -> str:
    sha = hashlib.sha256()
    for path in paths:
        sha.update(path.name.encode() + b"\0" + path.read_bytes())
    return sha.hexdigest()


def _settings() -> dict[str, Any]:
    """What the model file says besides its weights: how lines are chosen and when it answers."""
    return {
        "ngram_range": list(NGRAM_RANGE),
        "line_pattern": LINE_PATTERN,
        "context": CONTEXT,
        "min_probability": MIN_PROBABILITY,
        "doubt_probability": DOUBT_PROBABILITY,
    }


def _selector() -> LogModel:
    """A model with no weights: only its line selection, shared by fitting and inference."""
    return LogModel.from_dict({**_settings(), "classes": [], "weights": {}, "intercept": []})


def model_text(case: dict[str, Any]) -> str:
    return "\n".join(line.text for lines in _selector().select(case_logs(case)) for line in lines)


def fit_pipeline(cases: Sequence[dict[str, Any]]) -> Any:
    """scikit-learn's TF-IDF + logistic regression fit on `cases` (those with a line that looks like a
    failure), taking the text `model_text` selects."""
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline

    texts = [(model_text(case), case["class"]) for case in cases]
    texts = [(text, cls) for text, cls in texts if text]
    if len({cls for _, cls in texts}) < 3:
        # two classes make scikit-learn fit one sigmoid, not the softmax log_model.py applies
        raise SystemExit("the log model needs cases of at least 3 classes with a line that looks like a failure")
    vectorizer = TfidfVectorizer(
        analyzer="char_wb",
        ngram_range=NGRAM_RANGE,
        preprocessor=normalise,
        sublinear_tf=True,
        min_df=MIN_DOCUMENT_FREQUENCY,
    )
    regression = LogisticRegression(C=INVERSE_REGULARISATION, max_iter=5000)
    return make_pipeline(vectorizer, regression).fit([text for text, _ in texts], [cls for _, cls in texts])


def fit(cases: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The model's file content fit on `cases`."""
    vectorizer, regression = fit_pipeline(cases).named_steps.values()
    weights = {
        gram: [_rounded(vectorizer.idf_[j])] + [_rounded(w) for w in regression.coef_[:, j]]
        for gram, j in sorted(vectorizer.vocabulary_.items())
    }
    return {
        **_settings(),
        "classes": [str(c) for c in regression.classes_],
        "intercept": [_rounded(b) for b in regression.intercept_],
        "weights": weights,
    }


def _rounded(value: float) -> float:
    """Four significant digits: probabilities move by less than 1e-3, and the file is a third smaller."""
    return float(f"{value:.4g}")


def main() -> int:
    paths = corpus_files()
    cases = load_cases(paths)
    model = {"corpus_sha256": digest(paths), "cases": len(cases), **fit(cases)}
    temporary = OUTPUT.with_name(OUTPUT.name + ".tmp")
    # mtime=0: the same model is the same bytes (no churn in git, a stable Lambda asset hash)
    temporary.write_bytes(gzip.compress(json.dumps(model, separators=(",", ":"), sort_keys=True).encode(), mtime=0))
    temporary.replace(OUTPUT)
    print(
        f"{OUTPUT.relative_to(REPO)}: {len(cases)} cases, {len(model['weights'])} n-grams, "
        f"{len(model['classes'])} classes",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
