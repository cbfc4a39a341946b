"""The log model: a linear classifier over character n-grams, for the failures no rule names.

Rules are exact and reviewed, but each new set of public logs brings wordings no rule has seen. The
model generalises from the whole corpus instead: TF-IDF over character 3- to 5-grams (scikit-learn's
`char_wb` analyzer) of the lines that look like a failure, and a multinomial logistic regression
fit on every corpus case by scripts/failure_model.py, which writes log_model.json.gz. This module only
reads that file and applies it in plain Python (the classifier Lambda ships no numpy); a test checks
its probabilities against scikit-learn's. It answers only when its probability reaches the file's
`min_probability`, chosen by replaying the holdout sets (docs/operations.md, "Why a run failed").
"""

from __future__ import annotations

import functools
import gzip
import json
import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

MODEL_FILE = "log_model.json.gz"
MAX_LINES = 400
"""The model reads at most 400 selected lines, an equal share of each node's last ones (a long tail
says no more, and costs time; the main node, listed first, is always read)."""
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_HEX = re.compile(r"0x[0-9a-fA-F]+")
_DIGITS = re.compile(r"\d+")


def normalise(text: str) -> str:
    """What the n-grams are taken from: CamelCase split into words (RendezvousClosedError ->
    rendezvous closed error), hex numbers one token, other digits dropped, lower case."""
    return _DIGITS.sub(" ", _HEX.sub(" hexnum ", _CAMEL.sub(" ", text))).lower()


def char_ngrams(text: str, low: int, high: int) -> list[str]:
    """scikit-learn's `char_wb` analyzer: n-grams inside each word padded with one space."""
    grams = []
    for word in text.split():
        padded = f" {word} "
        for n in range(low, high + 1):
            grams += [padded[i:i + n] for i in range(max(len(padded) - n, 0) + 1)]
            if len(padded) <= n:  # a short word counts once
                break
    return grams


@dataclass(frozen=True)
class Line:
    node: str
    number: int
    """1-based, in that node's log."""
    text: str


@dataclass(frozen=True)
class Guess:
    cls: str
    probability: float
    lines: tuple[Line, ...]
    """The selected lines that weigh most for the class, in log order."""


@dataclass(frozen=True)
class LogModel:
    classes: tuple[str, ...]
    ngram_range: tuple[int, int]
    line_pattern: re.Pattern[str]
    context: int
    min_probability: float
    doubt_probability: float
    """A bare family name's class (a rule of tier generic) stands only when the model gives no other
    class this much."""
    weights: dict[str, tuple[float, ...]]
    """n-gram -> (idf, one coefficient per class)."""
    intercept: tuple[float, ...]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LogModel:
        return cls(tuple(data["classes"]), tuple(data["ngram_range"]), re.compile(data["line_pattern"], re.I),
                   data["context"], data["min_probability"], data["doubt_probability"],
                   {gram: tuple(values) for gram, values in data["weights"].items()}, tuple(data["intercept"]))

    def select(self, logs: Sequence[tuple[str, Sequence[str]]]) -> list[list[Line]]:
        """Per node (those with any), the lines that look like a failure with `context` lines either
        side. A line another node (or the same one) already showed, numbers aside, is read once: a
        hundred workers printing one error must not outweigh the main node's."""
        share = max(MAX_LINES // max(len(logs), 1), 1)
        by_node: list[list[Line]] = []
        seen: set[str] = set()
        for node, lines in logs:
            keep = sorted({j for i, text in enumerate(lines) if self.line_pattern.search(text)
                           for j in range(max(i - self.context, 0), min(i + self.context + 1, len(lines)))})
            picked = []
            for j in keep:
                key = " ".join(normalise(lines[j]).split())
                if key not in seen:
                    seen.add(key)
                    picked.append(Line(node, j + 1, lines[j].strip()))
            if picked:
                by_node.append(picked[-share:])
        return by_node

    def vector(self, text: str) -> dict[str, float]:
        """TF-IDF (sublinear tf, l2-normalised) over the model's n-grams, as scikit-learn computes it."""
        counts = Counter(g for g in char_ngrams(normalise(text), *self.ngram_range) if g in self.weights)
        values = {g: (1.0 + math.log(n)) * self.weights[g][0] for g, n in counts.items()}
        norm = math.sqrt(sum(v * v for v in values.values())) or 1.0
        return {g: v / norm for g, v in values.items()}

    def probabilities(self, text: str) -> dict[str, float]:
        return self._softmax(self.vector(text))

    def _softmax(self, x: dict[str, float]) -> dict[str, float]:
        scores = [b + sum(v * self.weights[g][k + 1] for g, v in x.items()) for k, b in enumerate(self.intercept)]
        top = max(scores)
        exp = [math.exp(s - top) for s in scores]
        total = sum(exp)
        return {name: e / total for name, e in zip(self.classes, exp)}

    def guess(self, logs: Sequence[tuple[str, Sequence[str]]], evidence: int = 3) -> Guess | None:
        """The class of the node the model is surest about (None: no line looks like a failure): each
        node is read on its own, so a hundred workers' symptoms do not dilute the one node with the
        cause. The caller decides what the probability is enough for (min_probability,
        doubt_probability)."""
        read = []
        for lines in self.select(logs):
            x = self.vector("\n".join(line.text for line in lines))
            probabilities = self._softmax(x)
            cls = max(probabilities, key=probabilities.__getitem__)
            read.append((probabilities[cls], cls, x, lines))
        if not read:
            return None
        probability, cls, x, lines = max(read, key=lambda r: r[0])
        column = self.classes.index(cls) + 1

        def weight(line: Line) -> float:
            """What the line's n-grams add to the class's score."""
            grams = set(char_ngrams(normalise(line.text), *self.ngram_range)) & x.keys()
            return sum(x[g] * self.weights[g][column] for g in grams)

        best = sorted(range(len(lines)), key=lambda i: -weight(lines[i]))[:evidence]
        return Guess(cls, probability, tuple(lines[i] for i in sorted(best)))


def parse_model(data: bytes, where: str = MODEL_FILE) -> LogModel:
    try:
        return LogModel.from_dict(json.loads(gzip.decompress(data)))
    except (OSError, EOFError, ValueError, KeyError, TypeError, re.error) as exc:
        raise ValueError(f"{where}: not a log model written by scripts/failure_model.py ({exc})") from None


@functools.cache
def _packaged_model() -> LogModel:
    return parse_model(resources.files(__package__).joinpath(MODEL_FILE).read_bytes())


def load_model(path: str | Path | None = None) -> LogModel:
    """The model shipped with the package (fit on the corpus), or another model file."""
    if path is None:
        return _packaged_model()
    return parse_model(Path(path).read_bytes(), str(path))
