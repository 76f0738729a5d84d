"""`moestack eval` checks first and loads only what it uses: only the validation split is
read into tokens (the training split is never tokenised), a model folder without weights is
refused before any corpus is read, and offloaded evaluation of a LoRA run (adapters on the
experts, which an expert store cannot hold) is refused before the model is loaded."""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers.runs import small_config

from moestack import cli
from moestack.config import DataConfig, LoRAConfig
from moestack.errors import MoestackError
from moestack.trainer import train

DATA = DataConfig(seq_len=32, max_bytes=200_000)


def _eval(*argv: str) -> dict:
    args = cli.build_parser().parse_args(["eval", *argv])
    return args.func(args)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    pytest.importorskip("transformers")
    from helpers.hf import tiny_hf_model_dir

    return tiny_hf_model_dir(tmp_path_factory.mktemp("hf"), "qwen3_moe")


@pytest.fixture
def tokenised(monkeypatch, tmp_path) -> list[tuple[str, int]]:
    """(split, documents) of every tokenisation done during the test, with a token cache of
    the test's own (empty: every split read is tokenised)."""
    import moestack.data

    monkeypatch.setenv("MOESTACK_DATA_CACHE", str(tmp_path / "token-cache"))
    calls: list[tuple[str, int]] = []
    real = moestack.data._tokenise

    def spy(documents, tokenizer, split):
        calls.append((split, len(documents)))
        return real(documents, tokenizer, split)

    monkeypatch.setattr(moestack.data, "_tokenise", spy)
    return calls


@pytest.fixture
def no_corpus(monkeypatch) -> list[str]:
    """Every way eval could read a corpus fails the test; returns the calls (none wanted)."""
    import moestack.data
    import moestack.runs

    calls: list[str] = []

    def refuse(name):
        def read(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"{name} was called: the corpus was read before the refusal")

        return read

    for module, name in (
        (moestack.data, "load_corpus"),
        (moestack.data, "stdlib_documents"),
        (moestack.data, "_file_documents"),
        (moestack.runs, "run_corpus"),
        (moestack.data.DataConfig, "build"),
    ):
        monkeypatch.setattr(module, name, refuse(name))
    return calls


def test_eval_of_a_model_folder_tokenises_the_validation_split_only(hf_folder, tokenised):
    from moestack.config import DataConfig
    from moestack.data import _split_documents, stdlib_documents

    result = _eval(str(hf_folder), "--max-bytes", "100000", "--batches", "1")
    assert result["loss/val"] > 0
    # the documents of the validation split, as load_corpus splits them (worked out here
    # from the split rule, with no tokenizer)
    packer, _ = _split_documents(stdlib_documents(), DataConfig(max_bytes=100_000))
    assert tokenised == [("val", len(packer.parts["val"]))]


def test_eval_of_a_run_tokenises_the_validation_split_only(tmp_path, monkeypatch):
    """A run of moestack's byte model: no tokenizer, so what is packed is watched instead."""
    import moestack.data

    train(small_config(steps=1, ckpt_every=0, data=DATA),
          tmp_path / "run")  # fmt: skip
    packed: list[str] = []
    real = moestack.data._pack

    def spy(documents, tokenizer, split):
        packed.append(split)
        return real(documents, tokenizer, split)

    monkeypatch.setattr(moestack.data, "_pack", spy)
    result = _eval(str(tmp_path / "run"), "--batches", "1")
    assert packed == ["val"]
    # the same loss as on the validation split load_corpus builds (both splits)
    monkeypatch.setattr(moestack.data, "_pack", real)
    from moestack.data import eval_batches, load_corpus
    from moestack.evaluation import evaluate
    from moestack.runs import load_run

    run = load_run(tmp_path / "run")
    val = load_corpus(run.cfg.data).val
    want = evaluate(run.model, eval_batches(val, run.cfg.batch_size, 32, 1), torch.device("cpu"))
    assert result["loss/val"] == pytest.approx(want["loss/val"], rel=1e-6)


@pytest.mark.parametrize("offload", [False, True], ids=["memory", "offload"])
def test_a_folder_without_weights_is_refused_before_any_corpus_is_read(
    hf_folder, tmp_path, no_corpus, offload
):
    folder = tmp_path / "no-weights"
    shutil.copytree(hf_folder, folder, ignore=shutil.ignore_patterns("*.safetensors*"))
    argv = [str(folder), "--max-bytes", "100000"] + (["--offload"] if offload else [])
    with pytest.raises(MoestackError, match=r"no-weights holds no model weights"):
        _eval(*argv)
    assert no_corpus == []


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora") / "run"
    cfg = small_config(steps=1, ckpt_every=0, trainable="lora", lora=LoRAConfig(rank=2),
                       data=DATA)  # fmt: skip
    train(cfg, out)
    return out


def test_offloaded_eval_of_a_lora_run_is_refused_before_the_model_is_loaded(
    lora_run, monkeypatch, no_corpus
):
    import moestack.runs

    loaded: list[str] = []

    def load_run(*args, **kwargs):
        loaded.append("load_run")
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(moestack.runs, "load_run", load_run)
    with pytest.raises(MoestackError, match="LoRA adapters on its experts") as err:
        _eval(str(lora_run), "--offload")
    assert "trainable=lora" in str(err.value) and "\n" not in str(err.value)
    assert loaded == [] and no_corpus == []


def test_offloaded_eval_of_an_attention_only_lora_run_is_not_refused_for_its_adapters(
    tmp_path,
):
    """Adapters on the attention alone stay in the model; the store serves the experts."""
    cfg = small_config(steps=1, ckpt_every=0, trainable="lora",
                       lora=LoRAConfig(rank=2, targets="attention"),
                       data=DATA)  # fmt: skip
    train(cfg, tmp_path / "run")
    result = _eval(str(tmp_path / "run"), "--offload", "--batches", "1", "--capacity", "2")
    assert result["loss/val"] > 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--policy", "belady"], "--policy belady needs the future"),
        (["--capacity", "1"], "--capacity 1 is below moe.top_k=2"),
    ],
    ids=["belady", "capacity"],
)
@pytest.mark.parametrize("kind", ["run", "folder"])
def test_offload_settings_are_refused_before_the_model_is_loaded(
    kind, argv, message, lora_run, hf_folder, monkeypatch, no_corpus
):
    """A cache that cannot serve (top-2 models: a run of moestack's and a qwen3_moe folder)."""
    import moestack.runs

    def load_run(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(moestack.runs, "load_run", load_run)
    where = lora_run if kind == "run" else hf_folder
    with pytest.raises(MoestackError, match=message):
        _eval(str(where), "--offload", *argv)
    assert no_corpus == []


@pytest.mark.parametrize("files", [1, 40], ids=["chunked", "documents"])
def test_the_validation_split_alone_is_load_corpus_s(tmp_path, files):
    """One file is cut into chunks to fill both splits; forty are split by name."""
    import numpy as np

    from moestack.config import TrainConfig
    from moestack.data import load_corpus
    from moestack.eval_corpus import validation_tokens

    rng = np.random.default_rng(0)
    for i in range(files):
        words = rng.choice(["alpha", "beta", "gamma", "delta\n"], size=60_000 // files)
        (tmp_path / f"doc{i}.txt").write_text(" ".join(words))
    data = DataConfig(source="files", paths=[str(tmp_path)], seq_len=32, val_fraction=0.1)
    want = load_corpus(data).val
    got = validation_tokens(TrainConfig(model=small_config().model, data=data))
    assert got.dtype == want.dtype and np.array_equal(got, want)
