"""moestack-train checks its overrides against the config before hydra composes them: a key
that names no field (typed plain, or with hydra's +, ++ or ~) and a value of the wrong type
are one line naming the override, the field and the fix, exit status 2, nothing written;
every override the project documents or uses stays accepted."""

from __future__ import annotations

import re
import shlex

import pytest
import yaml
from helpers.cli import TINY_ARGS, run_module
from helpers.paths import CONFIGS, EXPERIMENTS, REPO

from moestack.errors import MoestackError
from moestack.overrides import check_command_line, check_overrides
from moestack.prereg.spec import load


def refusal(overrides: list[str], sweep: bool = True) -> str:
    """The one-line message check_overrides refuses ``overrides`` with."""
    with pytest.raises(MoestackError) as err:
        check_overrides(overrides, sweep=sweep)
    message = str(err.value)
    assert "\n" not in message
    return message


# --------------------------------------------------------------------------- unknown keys
@pytest.mark.parametrize(
    "override, nearest",
    [
        ("optim.lrr=1e-3", "optim.lr"),
        ("+optim.lrr=1e-3", "optim.lr"),  # hydra's own advice for the line above
        ("++optim.lrr=1e-3", "optim.lr"),
        ("~optim.lrr", "optim.lr"),
        ("+router.temporall=0.5", "router.temporal"),
        ("model.d_modle=64", "model.d_model"),
        ("lr=1e-3", "optim.lr"),  # the right name in the wrong section
        ("seq_len=64", "data.seq_len"),
        ("router.pin_expert=3", "router.pin_experts"),  # never model.router.*: refused there
    ],
)
def test_a_key_that_names_no_field_is_refused_with_the_nearest(override, nearest):
    message = refusal([override])
    key = override.lstrip("+~").partition("=")[0]
    assert message.startswith(f"{override!r}: {key} is no field of the config")
    assert f"did you mean {nearest}?" in message


def test_a_refusal_gives_the_override_to_write_instead():
    assert "(write 'optim.lr=1e-3')" in refusal(["+optim.lrr=1e-3"])
    assert "moestack-train --help lists every field" in refusal(["zzzzzz=1"])


def test_a_config_group_option_must_exist():
    message = refusal(["model=smal"])
    assert "the model group has no option 'smal'; did you mean model=small?" in message
    assert "fine64, hf, m137, small, tiny" in message  # the files of configs/model/
    assert "the cache group has no option 'kv'" in refusal(["cache=lru,kv"])  # each of a sweep


def test_a_field_is_set_never_added_or_removed():
    assert "without the '+'" in refusal(["+optim.lr=1e-3"])
    assert "set it with optim.lr=VALUE" in refusal(["~optim.lr"])
    check_overrides(["++optim.lr=1e-3"])  # hydra's "add or override": sets the field


# --------------------------------------------------------------------------- values
@pytest.mark.parametrize(
    "override, expected",
    [
        ("seed=abc", "seed is an integer, not 'abc'"),
        ("optim.lr=abc", "optim.lr is a number, not 'abc'"),
        ("steps=1.5", "steps is an integer, not '1.5'"),
        ("steps=1e3", "steps is an integer, not '1e3'"),
        ("steps=null", "steps is an integer, not 'null'"),
        ("optim.lr=true", "optim.lr is a number, not 'true'"),
        ("compile=1", "compile is true or false, not '1'"),
        ("progress=yes", "progress is true or false, not 'yes'"),
        ("telemetry.capacities=[2,x]", "telemetry.capacities is a list of integers, not '[2,x]'"),
        (
            "data.paths=/srv/text",
            "data.paths is a list of texts, not '/srv/text'; write 'data.paths=[/srv/text]'",
        ),  # fmt: skip
        (
            "optim.betas=0.9",
            "optim.betas is a list of numbers, not '0.9'; write 'optim.betas=[0.9]'",
        ),  # fmt: skip
        ("model.moe=4", "model.moe is a section, not '4'; set its fields: model.moe.FIELD=VALUE"),
        ("lora.alpha=abc", "lora.alpha is a number, not 'abc'"),  # a number or null
        ("optim.experts.weight_decay=abc", "optim.experts.weight_decay is a number, not 'abc'"),
    ],
)
def test_a_value_of_the_wrong_type_names_field_value_and_type(override, expected):
    assert refusal([override]) == f"{override!r}: {expected}"


def test_values_of_the_right_type_pass():
    check_overrides([
        "seed=3", "optim.lr=1e-3", "optim.lr=1", "steps=1_000", "compile=True", "out_dir=runs/a",
        "lora.alpha=null", "lora.alpha=16", "optim.experts.weight_decay=null",
        "data.paths=[a.txt,corpus/]", "telemetry.capacities=[2,4]", "optim.betas=[0.9,0.99]",
        "optim.pipeline=auto", "optim.pipeline=true", "wandb_mode=", "out_dir=${oc.env:HOME}/r",
        "model.moe={num_experts:4,top_k:2}", "hydra.run.dir=x", "hydra/job_logging=disabled",
        "~telemetry", "model=hf", "model.path=/models/q",
    ])  # fmt: skip


def test_a_sweep_checks_each_value_and_a_run_takes_one():
    assert "seed is an integer, not 'x'" in refusal(["seed=0,x"])
    assert "add -m to run one job for each" in refusal(["seed=0,1"], sweep=False)
    assert "add -m to run one job for each" in refusal(["router=baseline,temporal"], sweep=False)
    assert "write 'data.paths=[a,b]'" in refusal(["data.paths=a,b"], sweep=False)
    check_command_line(["-m", "seed=0,1", "router=baseline,temporal", "optim.lr=range(1,3)"])
    with pytest.raises(MoestackError, match="add -m"):
        check_command_line(["seed=0,1"])


def test_flags_and_their_values_are_not_overrides():
    check_command_line(["--cfg", "job", "--package", "optim", "-cd", "/tmp/a=b", "seed=1"])
    with pytest.raises(MoestackError, match="did you mean optim.lr"):
        check_command_line(["--cfg", "job", "optim.lrr=2"])


# --------------------------------------------------------------------------- the command
@pytest.mark.parametrize(
    "override, expected",
    [
        ("+optim.lrr=1e-3", "did you mean optim.lr?"),  # trained with the typo dropped, before
        ("+router.temporall=0.5", "did you mean router.temporal?"),
        ("seed=abc", "seed is an integer, not 'abc'"),
        ("data.paths=/srv/text", "write 'data.paths=[/srv/text]'"),
    ],
)
def test_the_command_refuses_in_one_line_and_writes_nothing(tmp_path, override, expected):
    out = tmp_path / "run"
    done = run_module(*TINY_ARGS, override, f"out_dir={out}", cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().count("\n") == 0 and expected in done.stderr
    assert not out.exists() and not (tmp_path / "outputs").exists()


# --------------------------------------------------------------------------- documented ones
def _words_after(words: list[str], program: str) -> list[str] | None:
    """The words after ``program`` (a path ending in it, or ``-m moestack.train``)."""
    for i, word in enumerate(words):
        if word.endswith(program):
            return words[i + 1 :]
    return None


def _training_args(line: str) -> list[str] | None:
    """The moestack-train (or moestack plan) arguments of a documented command line; None
    when the line runs neither or shows placeholders (FIELD=VALUE, $var)."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return None
    args = _words_after(words, "moestack-train")
    if args is None:
        args = _words_after(words, "moestack.train")
    if args is None and "plan" in words and _words_after(words, "moestack") is not None:
        rest = words[words.index("plan") + 1 :]
        args = [w for i, w in enumerate(rest) if w != "--ranks" and rest[i - 1 : i] != ["--ranks"]]
    if args is None or any("$" in w or re.search(r"[A-Z]{4,}=", w) for w in args):
        return None
    flag_value = [i > 0 and args[i - 1].startswith("-") for i in range(len(args))]
    prose = [w for w, after_flag in zip(args, flag_value, strict=True)
             if "=" not in w and not w.startswith("-") and not after_flag]  # fmt: skip
    return None if prose or not args else args


def documented_command_lines() -> dict[str, list[str]]:
    """Every moestack-train command line of README.md, docs/*.md, scripts/*.sh, the help's
    common overrides (configs/train.yaml) and the tests' tiny run: where -> its words."""
    found: dict[str, list[str]] = {}
    sources = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), CONFIGS / "train.yaml"]
    sources += sorted((REPO / "scripts").glob("*.sh"))
    for path in sources:
        text = path.read_text().replace("\\\n", " ")
        for number, line in enumerate(text.splitlines(), 1):
            spans = re.findall(r"`([^`]*moestack[^`]*)`", line) or [line]
            for span in spans:
                args = _training_args(span)
                if args:
                    found[f"{path.name}:{number}"] = args
    help_block = yaml.safe_load((CONFIGS / "train.yaml").read_text())["hydra"]["help"]["template"]
    common = help_block.split("== Common overrides ==")[1].split("==")[0]
    for number, line in enumerate(common.splitlines()):
        words = shlex.split(line.strip().split("  ")[0])
        if words:
            found[f"train.yaml help line {number}"] = words
    found["tests/helpers/cli.py TINY_ARGS"] = list(TINY_ARGS)
    return found


def test_every_documented_command_line_is_accepted():
    lines = documented_command_lines()
    readme = [args for where, args in lines.items() if where.startswith("README.md:")]
    assert len(lines) >= 25 and ["model=small", "optim.lr=1e-3"] in readme  # its first is read
    for where, args in lines.items():
        try:
            check_command_line(args)
        except MoestackError as err:
            pytest.fail(f"{where}: {shlex.join(args)} is refused: {err}")


def test_every_studys_overrides_are_accepted():
    studies = sorted(EXPERIMENTS.glob("*.yaml"))
    assert len(studies) >= 5
    for path in studies:
        spec = load(path)
        for arm in spec.arms:
            overrides = list(spec.overrides(arm, spec.seeds[0]))
            try:
                check_overrides(overrides, sweep=False)
            except MoestackError as err:
                pytest.fail(f"{path.name} arm {arm}: {err}")
