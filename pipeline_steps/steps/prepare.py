"""prepare: validate records, quarantine bad ones, train the tokenizer, pre-tokenise, holdout split
(--phase plan|shard|finish as an array job). Its arguments and phases are still parsed in
pipeline_steps/prepare.py until that module is split by job."""

from __future__ import annotations

from .. import prepare


def main(argv: list[str] | None = None) -> int:
    return prepare.main(argv)
