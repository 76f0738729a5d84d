"""README's "Using it" commands, run in order as a user would, each in a shortened form that
keeps its words: a tiny model and a few steps appended to every training command, 2 ranks
for torchrun, the studies replaced by tiny copies of themselves (same arms and hypotheses,
2 seeds, 2 steps). A command that fails as written fails here. Two run lighter than written:
`compile=true` with dynamo disabled (its config and flags as written; inductor's compile of a
fresh model costs a minute here, and tests/model/test_compile.py compiles the trainer's run),
and `--generate 40` as 8 tokens."""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
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


class Readme(NamedTuple):
    """Where the commands ran, the tiny transformers folder DIR, and each command with its
    outcome, in README's order."""

    cwd: Path
    hf_dir: Path
    results: list[tuple[str, subprocess.CompletedProcess]]

    def outcome(self, command: str) -> subprocess.CompletedProcess:
        """The outcome of the one README command that reads ``command``."""
        (done,) = [done for cmd, done in self.results if cmd == command]
        assert done.returncode == 0, f"{command}: {done.stderr[-800:]}"
        return done


@pytest.fixture(scope="module")
def readme(tmp_path_factory) -> Readme:
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
    return Readme(cwd, hf_dir, results)


def test_every_readme_command_runs_as_written(readme):
    failed = [
        f"{command}\n  exit {done.returncode}: {(done.stderr or done.stdout).strip()[-800:]}"
        for command, done in readme.results
        if done.returncode != 0
    ]
    assert not failed, "README commands that fail:\n" + "\n".join(failed)
    assert len(readme.results) >= 20  # every line of the block ran


def test_no_readme_command_prints_a_traceback(readme):
    shown = [command for command, done in readme.results if "Traceback" in done.stderr]
    assert not shown, shown


def _printed_json(text: str) -> dict:
    """The JSON object a command printed first (eval prints its metrics, then any text)."""
    return json.JSONDecoder().raw_decode(text[text.index("{") :])[0]


def test_the_run_summary_and_eval_print_the_validation_loss(readme):
    """runs/a (trained, then resumed at its end): summary.json's validation loss is what
    the printed summary shows and what `moestack eval runs/a` prints, in memory and with its
    experts served by the cache; its perplexity is exp(loss); and a tiny model two steps from
    its initial weights predicts bytes about uniformly: a loss near ln(256)."""
    summary = json.loads((readme.cwd / "runs/a/summary.json").read_text())
    loss = summary["loss/val"]
    assert abs(loss - math.log(256)) < 0.5, loss
    assert summary["eval/perplexity"] == pytest.approx(math.exp(loss), rel=1e-6)
    trained = readme.outcome(".venv/bin/moestack-train out_dir=runs/a")
    assert re.search(rf"val loss +{loss:.4f} ", trained.stdout + trained.stderr)
    records = [json.loads(line) for line in (readme.cwd / "runs/a/metrics.jsonl").open()]
    train_losses = [r["loss/train"] for r in records if "loss/train" in r]
    assert summary["loss/train"] == train_losses[-1]
    for command in (".venv/bin/moestack eval runs/a",
                    ".venv/bin/moestack eval runs/a --offload --capacity 4 --policy lru "
                    "--prefetch"):  # fmt: skip
        printed = _printed_json(readme.outcome(command).stdout)
        assert printed["loss/val"] == loss, command
        assert printed["checkpoint"].endswith("checkpoints/step_000002"), printed
    dp = json.loads((readme.cwd / "runs/dp/summary.json").read_text())
    assert abs(dp["loss/val"] - math.log(256)) < 0.5 and dp["eval/perplexity"] == pytest.approx(
        math.exp(dp["loss/val"]), rel=1e-6
    )


def test_the_export_loads_in_transformers_with_the_trained_logits(readme):
    """`moestack export runs/hf OUT`: transformers loads OUT, and its logits are those of the
    fine-tuned run (its routers moved off DIR's, every other weight DIR's)."""
    from helpers.hf import reference_model, sample_tokens

    from moestack.runs import load_run

    readme.outcome(".venv/bin/moestack export runs/hf OUT")
    exported = reference_model(readme.cwd / "OUT")
    run = load_run(readme.cwd / "runs/hf")
    tokens = sample_tokens(run.model.cfg.doc_separator)
    with torch.no_grad():
        want = run.model(tokens).logits
        got = exported(input_ids=tokens).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    source = dict(reference_model(readme.hf_dir).named_parameters())
    moved = {n for n, p in exported.named_parameters() if not torch.equal(p, source[n])}
    assert moved and all(n.endswith("mlp.gate.weight") for n in moved), moved


def test_the_adapter_export_loads_in_peft_with_the_trained_logits(readme):
    """`moestack export runs/lora OUT-adapter --adapter`: peft puts the adapter on DIR's
    model, and the logits are those of the LoRA run."""
    import importlib.metadata

    from helpers.hf import reference_model, sample_tokens
    from packaging.version import Version

    from moestack.runs import load_run

    done = readme.outcome(".venv/bin/moestack export runs/lora OUT-adapter --adapter")
    try:
        holds = Version(importlib.metadata.version("peft")) >= Version("0.17")
    except importlib.metadata.PackageNotFoundError:
        holds = False
    if not holds:
        pytest.skip("no peft >= 0.17: the adapter is written in moestack's names")
    assert _printed_json(done.stdout)["adapter_format"] == "peft"
    import peft

    run = load_run(readme.cwd / "runs/lora")
    tokens = sample_tokens(run.model.cfg.doc_separator)
    adapted = peft.PeftModel.from_pretrained(
        reference_model(readme.hf_dir), readme.cwd / "OUT-adapter"
    )
    with torch.no_grad():
        want = run.model(tokens).logits
        got = adapted(input_ids=tokens).logits
        base = reference_model(readme.hf_dir)(input_ids=tokens).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(base, want, atol=1e-3)  # the adapter changed the model
