"""A run folder whose config.yaml is not the one training wrote (cut short, edited by hand,
from another version) is one line naming the file, for every verb that loads a run."""

from __future__ import annotations

import pytest

from moestack import cli
from moestack.config import TrainConfig, to_yaml
from moestack.errors import MoestackError
from moestack.runs import load_run_config

FIX = "put back the config.yaml that training wrote, or train the run again"


def test_a_run_config_as_training_writes_it_loads(tmp_path):
    (tmp_path / "config.yaml").write_text(to_yaml(TrainConfig(steps=7)))
    assert load_run_config(tmp_path).steps == 7


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda text: text + "model: [\n", "while parsing a flow node"),  # a write cut short
        (lambda text: text + "no_such_setting: 1\n", "no_such_setting"),  # a key of no config
        (lambda text: text.replace("steps: 300", "steps: many"), "steps"),  # a wrong type
        (lambda text: text.replace("top_k: 2", "top_k: 99"), "moe.top_k=99 is larger"),
    ],
    ids=["not-yaml", "unknown-key", "wrong-type", "out-of-range"],
)
def test_a_damaged_run_config_is_one_line_naming_the_file(tmp_path, capsys, damage, reason):
    path = tmp_path / "config.yaml"
    written = to_yaml(TrainConfig(steps=300))
    assert "steps: 300" in written
    path.write_text(damage(written))
    with pytest.raises(MoestackError) as err:
        load_run_config(tmp_path)
    message = str(err.value)
    assert message.startswith(f"{path} cannot be read as a run config (") and "\n" not in message
    assert reason in message and message.endswith(FIX)
    for verb in ("eval", "export"):
        argv = [verb, str(tmp_path)] + ([str(tmp_path / "out")] if verb == "export" else [])
        with pytest.raises(SystemExit) as exit_info:
            cli.main(argv)
        err_text = capsys.readouterr().err.strip()
        assert exit_info.value.code == 2 and "Traceback" not in err_text
        assert err_text == f"moestack {verb}: error: {message}"
