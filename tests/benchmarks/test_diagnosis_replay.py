"""`python -m benchmarks.diagnosis_replay --score`: a new set is scored the three ways the replay
reports. (The replay itself reads the rules' history from git, which a test cannot count on.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks import diagnosis_replay

# Real logs of the corpus: one a rule names (a full disk), one only the log model knows (a checkpoint
# that cannot be written), and the first again labelled with a class it is not (a wrong answer).
NEW_SET = """
[[case]]
id = "llamafactory-5155-storage-full"
source = "https://github.com/hiyouga/LlamaFactory/issues/5155"
class = "storage_error"
split = "new"
log = '''
safetensors_rust.SafetensorError: Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })
'''

[[case]]
id = "ronin-51-checkpoint-cannot-be-opened"
source = "https://github.com/Sachini/ronin/issues/51"
class = "storage_error"
split = "new"
log = '''
    super(_open_zipfile_writer_file, self).__init__(torch._C.PyTorchFileWriter(str(name)))
RuntimeError: File my_out/checkpoints/checkpoint_0.pt cannot be opened.
'''

[[case]]
id = "llamafactory-5155-mislabelled"
source = "https://github.com/hiyouga/LlamaFactory/issues/5155"
class = "nan_loss"
split = "new"
log = '''
safetensors_rust.SafetensorError: Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })
'''
"""


def test_a_new_set_is_scored_by_the_rules_then_with_the_model(tmp_path: Path, capsys) -> None:
    cases = tmp_path / "new.toml"
    cases.write_text(NEW_SET, encoding="utf-8")
    assert diagnosis_replay.main(["--score", str(cases)]) == 0
    header, row = capsys.readouterr().out.splitlines()
    assert "rules (first score)" in header and "rules + model (ships)" in header
    # right / wrong: the rules alone, rules + model as shipped, without its doubt bar, always answering
    assert re.findall(r"(\d+) \(\s*\d+%\) /\s+(\d+) \(", row) == [("1", "1"), ("2", "1"), ("2", "1"), ("2", "1")]


def test_a_higher_bar_leaves_to_unknown_what_the_model_alone_answers(tmp_path: Path, capsys) -> None:
    cases = tmp_path / "new.toml"
    cases.write_text(NEW_SET, encoding="utf-8")
    assert diagnosis_replay.main(["--score", str(cases), "--bars", "0,1"]) == 0
    header, row = capsys.readouterr().out.splitlines()
    assert "model bar 0.0: right / wrong" in header and "model bar 1.0: right / wrong" in header
    # bar 0 answers as "always"; bar 1 leaves the model's case unknown: the rules' answers alone remain
    assert re.findall(r"(\d+) \(\s*\d+%\) /\s+(\d+) \(", row)[-2:] == [("2", "1"), ("1", "1")]


@pytest.mark.parametrize("bars", ["0.3,x", "1.5"])
def test_a_bar_that_is_not_a_probability_is_refused(bars: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        diagnosis_replay.main(["--bars", bars])
    assert exit_.value.code == 2 and f"{bars!r}" in capsys.readouterr().err


def test_the_sets_come_in_order_and_an_unknown_split_is_refused() -> None:
    splits = ["holdout10", "holdout2", "dev", "holdout", "project"]
    assert sorted(splits, key=diagnosis_replay.split_rank) == ["dev", "project", "holdout", "holdout2", "holdout10"]
    with pytest.raises(ValueError, match="unknown split 'scratch'"):
        diagnosis_replay.split_rank("scratch")


def test_the_speed_run_times_both_ways_on_the_same_answer(capsys) -> None:
    diagnosis_replay.speed(nodes=3, lines=40)
    prefiltered, unfiltered, ratio = capsys.readouterr().out.splitlines()
    assert prefiltered.startswith("3 nodes x 40 lines, prefiltered: ") and prefiltered.endswith("(storage_error)")
    assert unfiltered.startswith("3 nodes x 40 lines, every rule on every line: ")
    assert unfiltered.endswith("(storage_error)") and ratio.startswith("speed-up: ")
