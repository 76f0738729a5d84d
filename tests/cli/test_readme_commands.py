"""README's "Using it" commands, run in order as a user would, each in a shortened form that
keeps its words: a tiny model and a few steps appended to every training command, 2 ranks
for torchrun, the studies replaced by tiny copies of themselves (same arms and hypotheses,
2 seeds, 2 steps). A command that fails as written fails here. Two run lighter than written:
`compile=true` with dynamo disabled (its config and flags as written; inductor's compile of a
fresh model costs a minute here, and tests/model/test_compile.py compiles the trainer's run),
and `--generate 40` as 8 tokens."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers.cli import TINY_MODEL, TINY_RUN
from helpers.paths import REPO

BIN = Path(sys.executable).parent


def readme_commands() -> list[list[str]]:
    """The command lines of README's "Using it" block (comments and continuations dropped)."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"## Using it\n\n```bash\n(.*?)```", text, re.S)
    assert block, "README.md has no 'Using it' bash block"
    commands = []
    for line in block.group(1).splitlines():
        words = shlex.split(line, comments=True)
        if words:
            commands.append(words)
    return commands


def shortened(words: list[str], hf_dir: Path) -> list[str]:
    """The command as run here: the venv's programs, DIR the tiny transformers folder, a tiny
    model and run appended to training, 2 ranks, a validation slice for a model folder."""
    words = [w.replace("DIR", str(hf_dir)) if "DIR" in w else w for w in words]
    head = words[0].removeprefix(".venv/bin/")
    if head.startswith("scripts/"):
        return ["bash", str(REPO / head), *words[1:]]
    words = [str(BIN / head), *words[1:]]
    if head == "torchrun":
        words = [("2" if w == "4" and words[i - 1] == "--nproc-per-node" else w)
                 for i, w in enumerate(words)]  # fmt: skip
    training = head == "moestack-train" or (head == "torchrun" and "moestack.train" in words)
    if training:
        hf = any(w == "model=hf" for w in words)
        words += ([] if hf else TINY_MODEL) + TINY_RUN
    if head == "moestack" and words[1] == "eval" and str(hf_dir) in words:
        words += ["--max-bytes", "100000"]
    if head == "moestack" and "--generate" in words:
        words[words.index("--generate") + 1] = "8"
    return words


def command_env(words: list[str], env: dict[str, str]) -> dict[str, str]:
    """The environment of one command: `compile=true` runs with dynamo disabled."""
    return {**env, "TORCHDYNAMO_DISABLE": "1"} if "compile=true" in words else env


def tiny_study(source: Path, out: Path, steps: int = 2) -> None:
    """``source`` with its arms and hypotheses, 2 seeds of ``steps`` steps of a tiny model,
    and a small evaluation."""
    spec = yaml.safe_load(source.read_text())
    spec["model"] = [*spec["model"], *TINY_MODEL]
    spec["data"] = [*spec["data"], "data.seq_len=32", "data.max_bytes=100000"]
    spec["budget"] = {"steps": steps, "batch_size": 2}
    spec["runs"]["seeds"] = spec["runs"]["seeds"][:2]
    if "power" in spec:
        spec["power"]["seeds"] = 2
    spec["analysis"].update(eval_batches=1, eval_batch_size=2, eval_seq_len=32, capacities=[2, 4])
    spec["analysis"]["scatter_capacity"] = 4
    train = [t for t in spec.get("train", []) if not t.startswith(("threads=", "ckpt_every="))]
    spec["train"] = [*train, "threads=1", "ckpt_every=0"]
    for hyp in spec.get("hypotheses", []):
        if "metric" in hyp:
            hyp["metric"] = hyp["metric"].replace("cap6", "cap4")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(spec, sort_keys=False))


@pytest.fixture(scope="module")
def readme_results(tmp_path_factory):
    pytest.importorskip("transformers")
    from helpers.hf import tiny_hf_model_dir

    cwd = tmp_path_factory.mktemp("user")
    hf_dir = tiny_hf_model_dir(tmp_path_factory.mktemp("hf"), "qwen3_moe")
    (cwd / "notes").mkdir()
    for i in range(6):
        (cwd / "notes" / f"n{i}.txt").write_text(f"note {i}: " + "the cache keeps experts. " * 400)
    (cwd / "more.jsonl").write_text('{"text": "one more document, some words."}\n' * 200)
    (cwd / "notes.txt").write_text("A text to route through a model. " * 200)
    tiny_study(REPO / "experiments/prereg_cpu_v2.yaml", cwd / "experiments/prereg_cpu_v2.yaml")
    env = {**os.environ, "WANDB_MODE": "disabled", "MOESTACK": str(BIN / "moestack")}
    results = []
    for words in readme_commands():
        argv = shortened(words, hf_dir)
        done = subprocess.run(
            argv, cwd=cwd, env=command_env(words, env), capture_output=True, text=True, timeout=900
        )
        results.append((" ".join(words), done))
    return results


def test_every_readme_command_runs_as_written(readme_results):
    failed = [
        f"{command}\n  exit {done.returncode}: {(done.stderr or done.stdout).strip()[-800:]}"
        for command, done in readme_results
        if done.returncode != 0
    ]
    assert not failed, "README commands that fail:\n" + "\n".join(failed)
    assert len(readme_results) >= 20  # every line of the block ran


def test_no_readme_command_prints_a_traceback(readme_results):
    shown = [command for command, done in readme_results if "Traceback" in done.stderr]
    assert not shown, shown
