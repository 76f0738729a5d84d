"""torchrun data parallel on the CPU (gloo, 2 processes) against the single-process run.

Launches are what these tests cost (each process imports torch), so launches that do not
depend on each other run side by side: a one-process run, or torchrun's own start, leaves a
core idle that the other launch uses."""

import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from helpers.multiprocess import file_rendezvous, run_gloo_rank, run_launch, spawn_ranks

from moestack import checkpoint
from moestack.metrics import read_metrics

SMALL = [
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.max_seq_len=32",
    "model.moe.num_experts=4",
    "model.moe.d_ff=32",
    "data.seq_len=32",
    "data.max_bytes=1000000",
    "telemetry=off",
    "steps=10",
    "batch_size=8",
    "log_every=1",
    "eval_every=0",
    "eval_batches=1",
    "ckpt_every=5",
    "keep_last=5",
    "progress=false",
    "wandb_mode=disabled",
    "threads=1",
]


def run(tmp_path, out_dir, nproc, *overrides):
    launcher = [sys.executable, "-m", "moestack.train"]
    if nproc > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                    "--standalone", "-m", "moestack.train"]  # fmt: skip
    result = run_launch(
        # load_balance off: its batch statistics are per rank, so not bit-comparable
        [*launcher, *SMALL, f"out_dir={out_dir}", *overrides, "router.load_balance=0"],
        f"moestack.train on {nproc} process(es) into {out_dir.name}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "gloo worker thread" not in result.stderr, result.stderr[-3000:]  # groups all ended
    return {
        r["step"]: r["loss/train"]
        for r in read_metrics(out_dir / "metrics.jsonl")
        if "loss/train" in r
    }


def side_by_side(*calls: tuple[Any, ...]) -> list[Any]:
    """Each ``(function, *args)`` of ``calls`` called in a thread of its own, all at once;
    their results in order (the first failure raised once all are done)."""
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(*call) for call in calls]
    return [future.result() for future in futures]


# OffloadAdamW with the aux-free router (its bias updates use the routing counts summed over
# the ranks) and torch AdamW with the baseline router: each optimizer and each router once
# (the router's part of a step is the model's, whichever optimizer steps after it).
@pytest.mark.parametrize("optim, router", [("adamw", "baseline"), ("offload_adamw", "aux_free")])
def test_two_gloo_ranks_match_one_process(tmp_path, optim, router):
    overrides = [f"optim={optim}", f"router={router}"]
    single, double = side_by_side(
        (run, tmp_path, tmp_path / "single", 1, *overrides),
        (run, tmp_path, tmp_path / "double", 2, *overrides),
    )
    assert sorted(single) == sorted(double) == list(range(1, 11))
    for step in single:
        assert double[step] == pytest.approx(single[step], rel=2e-5), step

    if optim == "offload_adamw":  # a 2-rank checkpoint (ZeRO shards, router biases) on 1 rank
        resumed = tmp_path / "resumed"
        shutil.copytree(tmp_path / "double", resumed)
        shutil.rmtree(resumed / "checkpoints" / "step_000010")
        assert checkpoint.latest_checkpoint(resumed / "checkpoints").name == "step_000005"
        after = run(tmp_path, resumed, 1, *overrides, "resume=true")
        for step in range(6, 11):
            assert after[step] == pytest.approx(double[step], rel=2e-5), step


def _bias_update_worker(rank: int, init_method: str, result_file: str) -> None:
    run_gloo_rank(rank, 2, init_method, _bias_update, rank, result_file)


def _bias_update(rank: int, result_file: str) -> None:
    import torch
    import torch.distributed as dist

    from moestack import ModelConfig, MoEConfig, MoETransformer, RouterConfig

    torch.manual_seed(0)
    cfg = ModelConfig(d_model=16, n_heads=2, n_layers=2, moe=MoEConfig(6, 2, 8),
                      router=RouterConfig(bias_update_rate=0.1, load_balance=0.0))  # fmt: skip
    model = MoETransformer(cfg).train()
    tokens = torch.randint(1, 256, (4, 16), generator=torch.Generator().manual_seed(7))
    model(tokens[2 * rank : 2 * rank + 2])  # each rank routes its half of the batch
    model.update_router_biases()
    if rank == 0:
        torch.save([m.router.expert_bias for m in model.moe_layers], result_file)
    biases = torch.cat([m.router.expert_bias for m in model.moe_layers])
    gathered = [torch.empty_like(biases) for _ in range(2)]
    dist.all_gather(gathered, biases)
    assert torch.equal(gathered[0], gathered[1]), gathered


def test_router_bias_update_uses_counts_summed_over_ranks(tmp_path):
    import torch

    from moestack import ModelConfig, MoEConfig, MoETransformer, RouterConfig

    result = tmp_path / "bias.pt"
    what = "the 2 gloo ranks of _bias_update_worker"
    spawn_ranks(_bias_update_worker, (file_rendezvous(tmp_path), str(result)), 2, what)
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=16, n_heads=2, n_layers=2, moe=MoEConfig(6, 2, 8),
                      router=RouterConfig(bias_update_rate=0.1, load_balance=0.0))  # fmt: skip
    model = MoETransformer(cfg).train()
    tokens = torch.randint(1, 256, (4, 16), generator=torch.Generator().manual_seed(7))
    model(tokens)  # one process, the whole batch
    model.update_router_biases()
    expected = [m.router.expert_bias for m in model.moe_layers]
    for got, want in zip(torch.load(result, weights_only=True), expected, strict=True):
        torch.testing.assert_close(got, want)


def _launch_with_rank_1(tmp_path, rank_1: str, what: str):
    """``moestack-train SMALL out_dir=run`` on 2 torchrun ranks, rank 1 running the Python
    ``rank_1`` first (its own config or code)."""
    script = tmp_path / "per_rank.py"
    body = "".join(f"    {line}\n" for line in rank_1.splitlines())
    script.write_text(f"import os\nif os.environ['RANK'] == '1':\n{body}"
                      "from moestack.train import main\nmain()\n")  # fmt: skip
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                "--standalone", str(script)]  # fmt: skip
    return run_launch([*launcher, *SMALL, f"out_dir={tmp_path / 'run'}"], what, cwd=tmp_path)


def test_ranks_started_with_different_configs_stop_with_one_line(tmp_path):
    """Rank 1 gets another optim.lr (and another model width): every rank stops at start,
    naming the fields, instead of training on (lr) or aborting in a collective (shapes)."""
    rank_1 = "import sys\nsys.argv += ['optim.lr=0.002', 'model.moe.d_ff=64']\n"
    done = _launch_with_rank_1(tmp_path, rank_1, "two ranks started with different configs")
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if "started with another config" in line]
    assert lines, done.stderr[-3000:]
    assert "ranks [1] started with another config than rank 0" in lines[0]
    assert "model.moe.d_ff 32 on rank 0, 64" in lines[0] and "optim.lr" in lines[0]
    assert "gloo" not in done.stderr.lower().replace("torch.distributed", "")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # no step was taken


def test_a_start_refused_on_one_rank_writes_nothing_on_any(tmp_path):
    """Rank 1 alone refuses its start after the ranks' config check (its impl check fails):
    rank 0 does not begin (no folder made, nothing written) and names rank 1 in one line."""
    rank_1 = (
        "from moestack import trainer\n"
        "from moestack.errors import MoestackError\n"
        "def refuse(*args):\n"
        "    raise MoestackError('rank 1 refuses this impl')\n"
        "trainer.check_impl = refuse\n"
    )
    done = _launch_with_rank_1(tmp_path, rank_1, "rank 1 refusing")
    assert done.returncode != 0
    assert "rank 1 refuses this impl" in done.stderr, done.stderr[-3000:]
    assert "rank(s) [1] refused the start" in done.stderr, done.stderr[-3000:]
    assert not (tmp_path / "run").exists()


# Two ranks that hold a group in a reference cycle (as an optimizer with hooks does) and leave
# collectives queued whose tensors only gloo still references, then end their groups:
# gloo's worker threads are gone before the interpreter exits, or the exit may abort.
GROUPS_SCRIPT = """
import os, sys
if sys.argv[1] == "first":
    from moestack import distributed  # as moestack's runs: before any group exists
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
torch.optim.SGD([torch.nn.Parameter(torch.randn(2))], lr=0.1)  # torch's lazy imports run here
from moestack import distributed
holder = {"group": dist.new_group([0, 1])}
holder["self"] = holder
for _ in range(50):
    dist.all_reduce(torch.randn(1000), async_op=True)
del holder
left = distributed.close_process_groups()
with open(f"{sys.argv[2]}/left{os.environ['RANK']}", "w") as f:  # one file a rank: no
    f.write(str(left))  # interleaved output to parse
"""


def _end_groups(tmp_path, order: str):
    script = tmp_path / f"groups_{order}.py"
    script.write_text(GROUPS_SCRIPT)
    out = tmp_path / f"left_{order}"
    out.mkdir()
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                "--standalone", str(script), order, str(out)]  # fmt: skip
    done = run_launch(launcher, f"two ranks ending their groups ({order})", cwd=tmp_path)
    lefts = [int(f.read_text()) for f in sorted(out.glob("left*"))]
    return done, lefts


@pytest.fixture(scope="module")
def ended_groups(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[subprocess.CompletedProcess, list[int]]]:
    """order -> (the launch, each rank's gloo threads left) of GROUPS_SCRIPT with
    moestack.distributed imported first and late, the two launched side by side."""
    tmp = tmp_path_factory.mktemp("groups")
    orders = ["first", "late"]
    return dict(zip(orders, side_by_side(*[(_end_groups, tmp, o) for o in orders]), strict=True))


def test_process_groups_end_with_their_gloo_threads_before_the_exit(ended_groups):
    done, lefts = ended_groups["first"]
    assert done.returncode == 0 and "terminate called" not in done.stderr, done.stderr[-3000:]
    assert lefts == [0, 0], done.stdout + done.stderr[-3000:]


def test_a_group_that_existed_when_torch_distributed_nn_was_imported_is_never_freed(ended_groups):
    """The cause of the random abort at exit, kept in view: torch's lazy import of
    torch.distributed.nn (from the first optimizer) after init_process_group binds the default
    group into its functions' defaults, so that group's threads outlive every teardown;
    moestack.distributed is imported before any group exists for this reason."""
    _, lefts = ended_groups["late"]
    assert lefts and all(left > 0 for left in lefts), lefts
