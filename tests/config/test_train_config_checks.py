"""Values refused when the run's config is built (or a layout is planned), not deep in a run:
the pinned experts, the wandb mode, and a batch the ranks cannot share."""

import pytest

from moestack.config import ModelConfig, MoEConfig, RouterConfig, TrainConfig
from moestack.errors import MoestackError
from moestack.metrics import MetricsWriter


def model() -> ModelConfig:
    """A model of 8 experts (a new one each time: a TrainConfig sets its router)."""
    return ModelConfig(moe=MoEConfig(num_experts=8, top_k=2))


def test_more_pinned_experts_than_experts_is_refused_naming_both():
    with pytest.raises(ValueError) as err:
        TrainConfig(model=model(), router=RouterConfig(pin=0.1, pin_experts=9))
    message = str(err.value)
    assert "router.pin_experts=9" in message and "model.moe.num_experts=8" in message
    assert "\n" not in message and "lower router.pin_experts" in message


def test_pinning_every_expert_or_no_pin_loss_is_accepted():
    assert TrainConfig(model=model(), router=RouterConfig(pin=0.1, pin_experts=8))
    assert TrainConfig(model=model(), router=RouterConfig(pin=0.0, pin_experts=9))  # loss off


@pytest.mark.parametrize("mode", ["ofline", "Offline", "dryrun", "off"])
def test_unknown_wandb_mode_is_refused(mode, tmp_path):
    with pytest.raises(ValueError) as err:
        TrainConfig(wandb_mode=mode)
    assert f"wandb_mode={mode!r} is unknown" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="wandb_mode"):
        MetricsWriter(tmp_path, wandb_mode=mode)
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("mode", ["", "online", "offline", "disabled"])
def test_wandb_modes_are_accepted(mode):
    assert TrainConfig(wandb_mode=mode).wandb_mode == mode


@pytest.mark.parametrize(
    "batch, ranks, named",
    [(16, 3, [15, 18]), (2, 3, [3]), (10, 4, [8, 12]), (7, 2, [6, 8])],
)
def test_a_batch_the_ranks_cannot_share_is_refused_naming_ones_they_can(batch, ranks, named):
    cfg = TrainConfig(batch_size=batch)
    with pytest.raises(MoestackError) as err:
        cfg.check_batch_split(ranks)
    message = str(err.value)
    assert f"batch_size={batch} does not split over {ranks} ranks" in message
    assert "\n" not in message
    for size in named:  # sizes worked by hand: multiples of ranks, next to batch
        assert str(size) in message.split("such as")[1]
        assert size % ranks == 0
        TrainConfig(batch_size=size).check_batch_split(ranks)


@pytest.mark.parametrize("batch, ranks", [(16, 1), (16, 2), (16, 4), (16, 16), (3, 3)])
def test_a_batch_the_ranks_share_passes(batch, ranks):
    TrainConfig(batch_size=batch).check_batch_split(ranks)
