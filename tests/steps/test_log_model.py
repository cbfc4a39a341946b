"""The failure classifier's log model: what no rule names (or only a weak rule), classified from the
corpus it was fit on, marked as the model's answer, with its evidence; computed as scikit-learn
computes it; refit with the corpus."""

from __future__ import annotations

import gzip
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression

from pipeline_steps.diagnosis import UNKNOWN, NodeLog, classify
from pipeline_steps.diagnosis.log_model import MODEL_FILE, load_model, normalise
from scripts.failure_model import OUTPUT, corpus_files, diagnose_case, digest, fit_pipeline, load_cases, model_text

from .conftest import run_cli

CASES = load_cases(corpus_files())
# A real log no rule names (a checkpoint that cannot be written), as the corpus has it.
(CHECKPOINT,) = [case["log"].splitlines() for case in CASES if case["id"] == "ronin-51-checkpoint-cannot-be-opened"]


def test_the_shipped_model_is_fit_on_todays_corpus() -> None:
    shipped = json.loads(gzip.decompress(OUTPUT.read_bytes()))
    assert shipped["corpus_sha256"] == digest(corpus_files()), (
        f"the corpus changed since {MODEL_FILE} was fit: run `make failure-model` and commit the file")


def test_the_model_computes_scikit_learns_probabilities() -> None:
    """The plain-Python TF-IDF and softmax (what the Lambda runs) against scikit-learn's own
    transform and predict_proba, given the shipped numbers (a refit may differ in the last digits
    from one BLAS or scikit-learn release to another; the arithmetic may not)."""
    model = load_model()
    grams = sorted(model.weights)
    vectorizer = TfidfVectorizer(analyzer="char_wb", ngram_range=model.ngram_range, preprocessor=normalise,
                                 sublinear_tf=True, vocabulary=grams).fit(["x"])
    vectorizer.idf_ = np.array([model.weights[g][0] for g in grams])
    regression = LogisticRegression()
    regression.classes_ = np.array(model.classes)
    regression.coef_ = np.array([[model.weights[g][k + 1] for g in grams] for k in range(len(model.classes))])
    regression.intercept_ = np.array(model.intercept)
    # every third case of the corpus (hundreds of real logs; the arithmetic is the same for all)
    texts = [text for case in CASES[::3] if (text := model_text(case))] + ["", "NaN", "\u00a0oom\u2028Killed  "]
    expected = regression.predict_proba(vectorizer.transform(texts))
    worst = max(abs(model.probabilities(text)[name] - p) for text, row in zip(texts, expected)
                for name, p in zip(model.classes, row))
    assert worst < 1e-9


def test_a_fresh_fit_of_the_corpus_gives_the_shipped_models_answers() -> None:
    """scripts/failure_model.py's fit, run here, answers as the shipped file does (all but a borderline
    case or two, should another BLAS or scikit-learn release move the last digits)."""
    pipeline, model = fit_pipeline(CASES), load_model()
    texts = [text for case in CASES if (text := model_text(case))]
    shipped = [max((p := model.probabilities(t)), key=p.__getitem__) for t in texts]
    agree = sum(a == b for a, b in zip(pipeline.predict(texts), shipped))
    assert agree >= 0.99 * len(texts), (agree, len(texts))


def test_what_no_rule_names_the_model_classifies_and_says_so() -> None:
    logs = [NodeLog.from_text("node-0", "step 10 loss 2.31\nstep 20 loss 2.05"), NodeLog("node-1", tuple(CHECKPOINT))]
    assert classify(logs, model=None).cls == UNKNOWN  # the rules alone
    diagnosis = classify(logs)
    assert (diagnosis.cls, diagnosis.decided_by, diagnosis.retryable) == ("storage_error", "log model", False)
    assert diagnosis.probability is not None and diagnosis.probability >= load_model().min_probability
    assert diagnosis.node == "node-1"
    assert [(e.node, e.line) for e in diagnosis.evidence if "cannot be opened" in e.text] == [("node-1", 2)]
    assert "Decided by: the log model, probability" in diagnosis.text()
    answer = diagnosis.as_dict()
    assert answer["decided_by"] == "log model" and 0.5 <= answer["probability"] <= 1


def test_a_confident_model_names_what_a_bare_exception_name_does_not(rules_with_generic) -> None:
    """No rule names SageMaker's CapacityError (the corpus's grand-challenge-2631 case); the model has
    seen it. A generic rule (tier generic: any exception class at a traceback's end is user code) yields
    to the model too."""
    (case,) = [c for c in CASES if c["id"] == "grand-challenge-2631-sagemaker-capacityerror"]
    assert diagnose_case(case, model=None).cls == UNKNOWN
    by_generic = diagnose_case(case, rules=rules_with_generic, model=None)
    assert (by_generic.cls, by_generic.evidence[0].rule) == ("user_code_error", "python-exception-any")
    for rules in (None, rules_with_generic):
        diagnosis = diagnose_case(case, rules=rules)
        assert (diagnosis.cls, diagnosis.decided_by) == ("capacity_or_infrastructure", "log model")


def test_a_generic_rule_stands_only_when_the_model_leans_nowhere_else(rules_with_generic) -> None:
    (case,) = [c for c in CASES if c["id"] == "grand-challenge-2631-sagemaker-capacityerror"]
    unsure = replace(load_model(), min_probability=1.0)  # never decides here, so only its doubt counts
    doubting = diagnose_case(case, rules=rules_with_generic, model=replace(unsure, doubt_probability=0.0))
    assert (doubting.cls, doubting.decided_by) == (UNKNOWN, "nothing")
    assert "Decided by: nothing: the rules saw only a bare family name (user_code_error, rule python-exception-any) " \
           "and the log model leans to" in doubting.text()
    trusting = diagnose_case(case, rules=rules_with_generic, model=replace(unsure, doubt_probability=1.0))
    assert (trusting.cls, trusting.decided_by, trusting.model_note) == ("user_code_error", "rule", None)


def test_below_its_minimum_probability_the_model_says_unknown() -> None:
    unsure = replace(load_model(), min_probability=1.0)
    diagnosis = classify([NodeLog("main", tuple(CHECKPOINT))], model=unsure)
    assert (diagnosis.cls, diagnosis.decided_by, diagnosis.probability) == (UNKNOWN, "nothing", None)


@pytest.mark.parametrize("exit_code, status_reason, expected, decided_by, retryable", [
    (65, None, "bad_input", "exit code", False),  # this project's own exit codes outrank the model,
    (75, None, UNKNOWN, "nothing", True),           # its retryable one too: Batch retries, the advice agrees
    (None, "Host EC2 (instance i-0abc) terminated.", "capacity_or_infrastructure", "rule", True),
])
def test_the_model_never_overrides_a_rule_or_the_exit_code(exit_code, status_reason, expected, decided_by,
                                                           retryable) -> None:
    diagnosis = classify([NodeLog("main", tuple(CHECKPOINT))], exit_code=exit_code, status_reason=status_reason)
    assert (diagnosis.cls, diagnosis.decided_by, diagnosis.retryable) == (expected, decided_by, retryable)


def test_a_hundred_workers_repeating_one_line_do_not_drown_the_main_node() -> None:
    """The main node's checkpoint failure; every worker then prints torchrun's shutdown (real lines,
    the corpus's nxdt-known-issues case), each with its own process id."""
    workers = [NodeLog.from_text(f"node-{i}", "\n".join(
        f"WARNING:torch.distributed.elastic.multiprocessing.api:Sending process {3721028 + 4 * i + k} closing "
        "signal SIGTERM" for k in range(4))) for i in range(1, 101)]
    diagnosis = classify([NodeLog("node-0", tuple(CHECKPOINT)), *workers])
    assert (diagnosis.cls, diagnosis.decided_by, diagnosis.node) == ("storage_error", "log model", "node-0")
    assert any(e.node == "node-0" and "cannot be opened" in e.text for e in diagnosis.evidence)


def test_the_command_prints_the_models_answer(tmp_path: Path) -> None:
    log = tmp_path / "node-0.log"
    log.write_text("\n".join(CHECKPOINT) + "\n")
    result = run_cli("diagnose", "--log", log, "--json")
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert (answer["class"], answer["decided_by"]) == ("storage_error", "log model")


def test_a_damaged_model_file_says_what_to_do(tmp_path: Path) -> None:
    damaged = tmp_path / MODEL_FILE
    damaged.write_bytes(b"not gzip")
    with pytest.raises(ValueError, match=f"{damaged}: not a log model written by scripts/failure_model.py"):
        load_model(damaged)


def test_enomem_text_alone_is_a_bare_family_name_the_model_may_doubt() -> None:
    """`Cannot allocate memory` is what any call that could not allocate prints (here an RDMA verb short
    of locked memory), so its rule is tier generic: it stands when the model leans nowhere else and
    leaves the answer unknown when the model leans to another class."""
    logs = [NodeLog("node 0", ("ibv_alloc_pd failed: Cannot allocate memory",))]
    unsure = replace(load_model(), min_probability=1.0)  # never decides here, so only its doubt counts
    assert classify(logs, model=replace(unsure, doubt_probability=1.0)).cls == "host_oom"
    doubted = classify(logs, model=replace(unsure, doubt_probability=0.0))
    assert doubted.cls == UNKNOWN
    assert doubted.model_note is not None and "rule host-cannot-allocate" in doubted.model_note
