"""trainable=routers / routers+experts: only those weights change, the rest gets no
gradient buffer and no optimizer state."""

import pytest
import torch
from helpers.runs import small_config

from moestack.config import OptimConfig
from moestack.distributed import DistInfo
from moestack.model import MoETransformer
from moestack.trainer import build_run


@pytest.mark.parametrize("optim", ["adamw", "offload_adamw"])
@pytest.mark.parametrize("which", ["routers", "routers+experts"])
def test_only_the_chosen_weights_train(tmp_path, which, optim):
    cfg = small_config(trainable=which, optim=OptimConfig(name=optim, lr=1e-2, warmup_steps=1))
    run = build_run(cfg, tmp_path, DistInfo())
    before = {k: v.clone() for k, v in run.model.state_dict().items()}
    for _ in range(3):
        run.train_step()
    after = run.model.state_dict()
    expected = {f"layers.{i}.moe.router.weight" for i in range(cfg.model.n_layers)}
    if which == "routers+experts":
        expected |= {f"layers.{i}.moe.{w}" for i in range(cfg.model.n_layers) for w in ("w1", "w2")}
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == expected
    frozen = [p for p in run.model.parameters() if not p.requires_grad]
    assert frozen and all(p.grad is None for p in frozen)
    if optim == "adamw":
        assert len(run.optimizer.state) == len(expected)  # state only for what trains
    else:  # keyed by parameter name; stacked experts one entry per expert (".../expert3")
        names = {key.split("/")[0] for key in run.optimizer.state_dict()["state"]}
        assert names == expected
    run.writer.close()


def test_unknown_trainable_is_refused():
    with pytest.raises(ValueError, match="trainable='heads'"):
        small_config(trainable="heads")
    with pytest.raises(ValueError, match="trainable='x'"):
        MoETransformer(small_config().model).set_trainable("x")
