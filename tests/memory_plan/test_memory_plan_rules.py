"""The memory plan counts what the optimizers allocate, with their own rules (issue 28), and
plans a run from the run's model instead of building it again."""

import pytest
import torch
from helpers.memory import batch, tiny
from helpers.native_kernel import native_kernel
from helpers.runs import small_config

from moestack import memory_plan
from moestack.config import OptimConfig, ParallelConfig
from moestack.memory_plan import plan_memory
from moestack.model import ModelConfig
from moestack.optim import OffloadAdamW, apply_param_dtype, build_optimizer, param_groups
from moestack.parallel import ExpertParallelMesh, expert_params, shard_experts
from moestack.trainer import train

# host buffer roles of OffloadAdamW.host_buffers() -> the plan line that counts them
LINE_OF_ROLE = {
    "exp_avg": "optimizer moments",
    "exp_avg_sq": "optimizer moments",
    "master": "optimizer master weights",
    "grad_comm": "gradient pack buffers",
    "grad_shard": "gradient pack buffers",
    "weight_staging": "weight staging",
    "grad_spare": "delayed update: spare gradient buffer",
}


def _nbytes(t):
    return t.numel() * t.element_size()


def _lines(plan, where, label=""):
    """Bytes of each line of ``plan`` at ``where`` whose name ends with ``label``, keyed by
    the line's name without the label (and without a ", low halves")."""
    out = {}
    for ln in plan.lines:
        if ln.where == where and ln.what.endswith(label):
            what = ln.what[: len(ln.what) - len(label)].split(",")[0].split(" (")[0]
            out[what] = out.get(what, 0) + ln.bytes
    return out


def _by_line(buffers):
    out = {}
    for role, t in buffers.items():
        if role == "bf16_moment_scratch":  # the reference step's, for bf16 moments: not planned
            continue
        out[LINE_OF_ROLE[role]] = out.get(LINE_OF_ROLE[role], 0) + _nbytes(t)
    return out


@pytest.mark.parametrize(
    "optim",
    [
        {},  # fp32 on one CPU process: stepped in place
        {"param_dtype": "bfloat16"},  # the direct fused step, split master (native kernel)
        {"param_dtype": "bfloat16", "fused_step": "off"},  # the reference path
        {"fused_step": "off", "moment_dtype": "bfloat16"},
        {"update_delay": 1},  # a master copy and a spare gradient buffer
        {"update_delay": 1, "param_dtype": "bfloat16"},
        {"pipeline": True, "param_dtype": "bfloat16"},  # bf16 gradient buffer, staging
        {"pipeline": True},  # fp32: a master copy, fp32 gradients
    ],
    ids=[
        *("fp32", "bf16-fused", "bf16-reference", "bf16-moments", "delayed", "delayed-bf16"),
        *("pipelined-bf16", "pipelined-fp32"),
    ],
)
def test_offload_plan_lists_exactly_what_the_optimizer_allocates_on_the_cpu(optim):
    """Line by line, byte for byte: the host buffers a real OffloadAdamW holds after a step,
    and its device scratch (none on the CPU: no copy changes dtype on a GPU there)."""
    cfg = tiny(optim={"name": "offload_adamw", **optim})
    plan = plan_memory(cfg, ranks=1, device="cpu")
    torch.manual_seed(0)
    model = cfg.model.build()
    apply_param_dtype(model, cfg.optim, torch.device("cpu"))
    optimizer = build_optimizer(model, cfg.optim)
    tokens, targets = batch()
    model(tokens, targets=targets).loss.backward()
    optimizer.step()
    if optimizer.host_step not in ("in_place", "native", "off"):  # the native kernel is out
        native_kernel()  # skips without a C++ compiler, fails naming why with one
        raise AssertionError(f"the native kernel loads, yet the step ran {optimizer.host_step}")
    optimizer.synchronize()
    assert _lines(plan, "host") == _by_line(optimizer.host_buffers())
    device = _lines(plan, "device")
    scratch = sum(_nbytes(t) for t in optimizer.device_buffers().values())
    assert device.get("offload dtype scratch", 0) == scratch == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fused_step", ["auto", "off"])
def test_offload_plan_lists_exactly_what_the_optimizer_allocates_on_cuda(fused_step):
    """bf16 weights on the GPU: the host buffers (a staging buffer and a split master with
    the native kernel) and the device's fp32 dtype scratch, after a step."""
    cfg = tiny(optim={"name": "offload_adamw", "fused_step": fused_step})
    plan = plan_memory(cfg, ranks=1, device="cuda")
    torch.manual_seed(0)
    model = cfg.model.build().cuda()
    apply_param_dtype(model, cfg.optim, torch.device("cuda"))
    optimizer = build_optimizer(model, cfg.optim)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    torch.cuda.synchronize()
    if optimizer.host_step not in ("native", "off"):  # the native kernel is out
        native_kernel()  # skips without a C++ compiler, fails naming why with one
        raise AssertionError(f"the native kernel loads, yet the step ran {optimizer.host_step}")
    assert _lines(plan, "host") == _by_line(optimizer.host_buffers())
    scratch = sum(_nbytes(t) for t in optimizer.device_buffers().values())
    # pipelined (the fused step's default on a GPU): bf16 gradients cross as they are
    assert optimizer.pipelined == (fused_step == "auto")
    if optimizer.pipelined:
        assert _lines(plan, "device").get("offload dtype scratch", 0) == scratch == 0
    else:
        assert _lines(plan, "device")["offload dtype scratch"] == scratch > 0


def test_experts_state_of_a_one_rank_group_is_planned_as_its_optimizer_holds_it():
    """parallel.ep = ranks: each rank's experts are its own (their data-parallel group is one
    process), so their OffloadAdamW is not distributed: on the CPU with fp32 weights it
    steps them in place, with no master copy and no gradient buffers."""
    cfg = tiny(optim={"name": "offload_adamw"}, parallel=ParallelConfig(ep=2))
    plan = plan_memory(cfg, ranks=2, device="cpu")
    torch.manual_seed(0)
    model = cfg.model.build()
    shard_experts(model, ExpertParallelMesh(2, 2, 0, 0, None, None))  # rank 0's experts
    experts = expert_params(model)
    groups = [
        dict(g, params=[(n, p) for n, p in g["params"] if id(p) in experts])
        for g in param_groups(model, cfg.optim.weight_decay)
    ]
    optimizer = OffloadAdamW([g for g in groups if g["params"]])  # a group of one process
    assert optimizer.host_step == "in_place"
    assert _lines(plan, "host", " (experts)") == _by_line(optimizer.host_buffers())


@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize("name", ["adamw", "offload_adamw"])
def test_a_plan_from_the_runs_model_is_the_plan_from_its_config(monkeypatch, ep, name):
    """Given the run's model (trainable set, this rank's experts cut), the plan reads its
    shapes and builds no model; the table is the one the config alone gives."""
    cfg = tiny(optim={"name": name}, trainable="routers+experts", parallel=ParallelConfig(ep=ep))
    want = plan_memory(cfg, ranks=2, device="cpu").format()
    torch.manual_seed(0)
    model = cfg.model.build()
    model.set_trainable(cfg.trainable)
    if ep > 1:
        shard_experts(model, ExpertParallelMesh(2, ep, 0, 0, None, None))
    builds = []
    monkeypatch.setattr(ModelConfig, "build", lambda *a, **k: builds.append(1))
    assert plan_memory(cfg, ranks=2, device="cpu", model=model).format() == want
    assert builds == []


def test_a_training_run_builds_its_model_once(tmp_path, monkeypatch, caplog):
    """The plan logged at start comes from the run's own model, not a second build."""
    builds = []
    build = ModelConfig.build

    def counting(self, *args, **kw):
        builds.append(1)
        return build(self, *args, **kw)

    monkeypatch.setattr(ModelConfig, "build", counting)
    with caplog.at_level("INFO", logger=memory_plan.__name__):
        train(small_config(steps=1, optim=OptimConfig(name="offload_adamw")), tmp_path)
    assert len(builds) == 1
    assert any("memory plan (per rank)" in r.getMessage() for r in caplog.records)


def test_plan_refuses_a_batch_training_refuses_with_the_same_line(tmp_path):
    """``moestack plan --ranks 3`` of a batch of 16: refused as a 3-rank run refuses it
    (one rule), naming batch sizes 3 ranks share (15 and 18: multiples of 3, by hand)."""
    from moestack.distributed import DistInfo
    from moestack.errors import MoestackError
    from moestack.trainer import build_run

    cfg = small_config(batch_size=16)
    with pytest.raises(MoestackError) as planned:
        plan_memory(cfg, ranks=3, device="cpu")
    with pytest.raises(MoestackError) as trained:
        build_run(cfg, tmp_path / "run", DistInfo(rank=0, world_size=3))
    assert str(planned.value) == str(trained.value)
    assert "batch_size=16 does not split over 3 ranks" in str(planned.value)
    assert "batch_size=15 or 18" in str(planned.value)
    assert not (tmp_path / "run").exists()  # refused before anything was written
    for size in (15, 18):
        assert plan_memory(small_config(batch_size=size), ranks=3, device="cpu").ranks == 3
