"""TieredAdamW's C++ kernel (kernels/host_tiered.cpp) against its torch ops
(kernels/host_tiered.py): the same weights and state bit for bit; the sums' order and the
rounding noise against values worked out here by hand."""

from __future__ import annotations

import pytest
import torch
from _tiered_testlib import run_steps, set_grads, small_model

from moestack.config import OptimConfig
from moestack.kernels import host_build, host_tiered
from moestack.optim import build_optimizer
from moestack.optim.tiered import TieredAdamW
from moestack.populations import PopulationConfig


@pytest.fixture(scope="module")
def kernel() -> host_tiered.TieredKernel:
    """The C++ kernel; skips without a compiler, fails where one exists and it does not load."""
    if not host_build.find_compiler():
        pytest.skip("no C++ compiler for the host kernel")
    got = host_tiered.kernel_or_none()
    assert got is not None, f"a compiler is there, yet the kernel is not: {host_tiered._LOADED}"
    return got


def _pair(dtype: torch.dtype, **kw: object) -> tuple[list[torch.nn.Module], list[TieredAdamW]]:
    models, opts = [], []
    for on_host in (True, False):
        model = small_model(dtype)
        torch.manual_seed(1)
        opt = build_optimizer(model, OptimConfig(name="tiered", lr=1e-2, **kw))
        assert isinstance(opt, TieredAdamW)
        opt.host_kernel = on_host
        models.append(model)
        opts.append(opt)
    return models, opts


@pytest.mark.parametrize(
    "dtype,kw",
    [
        (torch.bfloat16, {}),  # master=none: stochastic rounding into bf16
        (torch.float32, {}),  # master=none onto the bf16 grid in fp32 storage
        (torch.bfloat16, {"master": "float32"}),
        (torch.float32, {"master": "float32", "clip_update": 0.0}),
    ],
)
def test_kernel_and_torch_ops_step_to_the_same_bits(kernel, dtype, kw) -> None:  # noqa: ANN001
    (a, b), (oa, ob) = _pair(dtype, **kw)
    run_steps(a, oa, range(4))
    run_steps(b, ob, range(4))
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name
        for key, value in oa.state[p].items():
            other = ob.state[q][key]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
    assert oa.metrics() == pytest.approx(ob.metrics(), rel=1e-12)


def test_momentum_in_bf16_and_full_moments_agree(kernel) -> None:  # noqa: ANN001
    """Every population with bf16 momentum and a full second moment."""
    pops = ("experts", "routers", "embeddings", "backbone")
    overrides = {p: PopulationConfig(momentum="bfloat16", second_moment="full") for p in pops}
    (a, b), (oa, ob) = _pair(torch.bfloat16, **overrides)
    run_steps(a, oa, range(3))
    run_steps(b, ob, range(3))
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_large_units_stepped_by_all_threads_agree(kernel) -> None:  # noqa: ANN001
    """Units past host_tiered.TOGETHER elements are split over the threads by rows and column
    blocks: the same bits as the torch ops, on 2 threads."""
    gen = torch.Generator().manual_seed(3)
    shape = (2, 520, 510)  # 265,200 elements an expert: stepped together
    assert shape[1] * shape[2] >= host_tiered.TOGETHER
    jobs = []
    for _ in range(2):
        w = torch.randn(shape, generator=gen).bfloat16()
        g = torch.randn(shape, generator=gen)
        row, col = torch.rand(2, 520, generator=gen), torch.rand(2, 510, generator=gen)
        keys = torch.tensor([7, 11], dtype=torch.int32)
        coef = host_tiered.coefficients(1e-2, (0.9, 0.95), 1e-8, 2, 0.1, 1.0, False, 520, 510,
                                        520 * 510)  # fmt: skip
        jobs.append(host_tiered.Job(w, g, None, None, row, col, None, keys, 2, 2, 520, 510, coef))
    twin = [host_tiered.Job(*(t.clone() if isinstance(t, torch.Tensor) else t for t in j))
            for j in jobs]  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = kernel(jobs)
    finally:
        torch.set_num_threads(threads)
    want = [host_tiered.step_torch(j) for j in twin]
    for j, t in zip(jobs, twin, strict=True):
        assert torch.equal(j.w, t.w) and torch.equal(j.row, t.row) and torch.equal(j.col, t.col)
    assert [x for pair in got for x in pair] == pytest.approx([x for pair in want for x in pair])


@pytest.mark.parametrize("momentum", [None, torch.float32])
def test_every_row_width_and_height_steps_to_the_torch_bits(kernel, momentum) -> None:  # noqa: ANN001
    """Rows of 1 to 255 elements and matrices of 1 to 130 rows (the kernel ends each halving
    tree at 64 values or fewer with code for each size, pairs two rows' sums and takes a row's
    update with its squares in one pass): the torch ops' bits, factored and full. (A matrix of
    one column once failed: the torch ops' row sum of one value was a view of the squares,
    then scaled in place, so the column sums read scaled squares.)"""
    gen = torch.Generator().manual_seed(3)
    jobs = []
    for cols in (1, 2, 3, 8, 16, 33, 64, 97, 128, 255):
        for rows in (1, 2, 7, 16, 45, 130):
            for factored in (True, False):
                shape = (2, rows, cols)
                coef = host_tiered.coefficients(1e-2, (0.9, 0.95), 1e-8, 2, 0.1, 0.5,
                                                momentum is not None, rows, cols, rows * cols)  # fmt: skip
                jobs.append(host_tiered.Job(
                    torch.randn(shape, generator=gen), torch.randn(shape, generator=gen),
                    None if momentum is None else torch.randn(shape, generator=gen),
                    None if factored else torch.rand(shape, generator=gen),
                    torch.rand(2, rows, generator=gen) if factored else None,
                    torch.rand(2, cols, generator=gen) if factored else None,
                    None, None, 2, 2, rows, cols, coef,
                ))  # fmt: skip
    twin = [host_tiered.Job(*(t.clone() if isinstance(t, torch.Tensor) else t for t in j))
            for j in jobs]  # fmt: skip
    got = kernel(jobs)
    want = [host_tiered.step_torch(j) for j in twin]
    for j, t in zip(jobs, twin, strict=True):
        for x, y in zip(j, t, strict=True):
            assert not isinstance(x, torch.Tensor) or torch.equal(x, y), (j.rows, j.cols)
    assert [x for pair in got for x in pair] == pytest.approx([x for pair in want for x in pair])


def test_tree_sum_order_by_hand() -> None:
    """Five values, n=5: [x0+x3, x1+x4, x2], then [(x0+x3)+x2, x1+x4], then their sum; in
    fp32 the order shows (1e8 + 1 rounds to 1e8)."""
    x = torch.tensor([1e8, 1.0, 3.0, -1e8, 1.0])
    f = torch.tensor
    want = ((f(1e8) + f(-1e8)) + f(3.0)) + (f(1.0) + f(1.0))
    assert torch.equal(host_tiered.tree_sum(x, 0), want) and float(want) == 5.0


def _mix32(x: int) -> int:
    """host_tiered.cpp's mix32 in Python's integers (mod 2^32)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x5BD1E995) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_noise_is_the_hash_of_key_and_index() -> None:
    """The noise of element i of a unit with key k is mix32(mix32(i) ^ k) >> 16 (checked in
    Python's integers); a unit's key depends on (seed, name, expert, step) alone."""
    keys = torch.tensor([host_tiered.unit_key(5, "w", e, 3) for e in (0, 1)], dtype=torch.int32)
    bits = host_tiered.noise(keys, 70)
    for e in (0, 1):
        k = int(keys[e])
        assert bits[e].tolist() == [_mix32(_mix32(i) ^ k) >> 16 for i in range(70)]
    assert host_tiered.unit_key(5, "w", 0, 3) == host_tiered.unit_key(5, "w", 0, 3)
    others = {host_tiered.unit_key(*a) for a in ((6, "w", 0, 3), (5, "v", 0, 3), (5, "w", 1, 3),
                                                 (5, "w", 0, 4), (5, "w", None, 3))}  # fmt: skip
    assert host_tiered.unit_key(5, "w", 0, 3) not in others and len(others) == 5


@pytest.mark.parametrize("master", ["none", "float32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_torch_ops_allocate_no_more_than_planned(master: str, dtype: torch.dtype) -> None:
    """The torch ops' step (a device's, or a CPU's without a compiler) allocates at its peak
    within the plan's line for tensors they step (meta tensors: not the C++ kernel's), and
    most of it."""
    from helpers.alloc import PeakAllocated

    from moestack.optim.tiered_bytes import planned_step_bytes
    from moestack.populations import classify

    model = small_model(dtype)
    torch.manual_seed(1)
    cfg = OptimConfig(name="tiered", master=master)
    opt = build_optimizer(model, cfg)
    opt.host_kernel = False
    for step in range(2):  # the first step makes the state, the second is measured
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step)).to(dtype)
        with PeakAllocated() as measured:
            opt.step()
    named = [(n, p.to("meta")) for n, p in model.named_parameters()]
    planned = planned_step_bytes(named, classify(model), cfg.policy, master, dtype)
    assert 0.6 * planned <= measured.peak <= planned, (measured.peak, planned)


def test_state_of_another_size_is_not_given_to_the_kernel() -> None:
    """A job whose state does not fit its weights (a restored state of another shape) goes
    to the torch ops, never through a pointer the kernel would read past."""
    job = host_tiered._check_job(0, torch.Generator().manual_seed(0))  # factored
    assert host_tiered.takes(job)
    assert not host_tiered.takes(job._replace(row=job.row[:, :-1].contiguous()))
    assert not host_tiered.takes(job._replace(col=job.col.double()))
    assert not host_tiered.takes(job._replace(g=job.g[:, :, :-1].contiguous()))
    assert not host_tiered.takes(job._replace(keys=job.keys[:1]))
    assert not host_tiered.takes(job._replace(units=0))


def test_a_state_tensor_replaced_between_steps_is_checked_again(kernel) -> None:  # noqa: ANN001
    """The kernel's checks of a tensor are remembered between steps; a state tensor replaced
    by one that does not fit (here the second moment, by one of half the size) is checked
    again and its update goes to the torch ops, which refuse it by name, instead of the
    kernel reading past its end."""
    model = torch.nn.Linear(8, 6, bias=False)
    pops = {"backbone": PopulationConfig(momentum="none", second_moment="full")}
    opt = build_optimizer(model, OptimConfig(name="tiered", **pops))
    assert isinstance(opt, TieredAdamW)
    model.weight.grad = torch.ones_like(model.weight)
    opt.step()
    st = opt.state[model.weight]
    st["v"] = torch.zeros(3, 8)
    with pytest.raises(RuntimeError):
        opt.step()


def _changes(model: torch.nn.Module, opt: TieredAdamW, step: int) -> None:
    """What a run may change between steps, one kind a step: the learning rate (a schedule),
    a tensor with no gradient (it misses a step: step counts then differ), a non-contiguous
    gradient, betas, the clip, a state tensor's memory swapped under the same tensor, a
    parameter's state replaced by an empty dict (it starts again)."""
    params = list(model.parameters())
    matrix = next(p for n, p in model.named_parameters() if n.endswith("router.weight"))
    if step == 1:
        for g in opt.param_groups:
            g["lr"] *= 0.5
    if step == 2:
        params[3].grad = None
    if step == 4:
        matrix.grad = matrix.grad.t().contiguous().t()
        assert not matrix.grad.is_contiguous()
    if step == 5:
        opt.param_groups[0]["betas"] = (0.8, 0.9)
    if step == 6:
        opt.clip_update = 4.0  # few clipped: the statistics are not sums of whole numbers
    if step == 7:
        v = opt.state[matrix]["v"]
        v.data = v.detach().clone()  # the same tensor object at another address
    if step == 8:
        opt.state[params[0]] = {}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_descriptors_kept_between_steps_step_to_the_torch_bits(kernel, dtype) -> None:  # noqa: ANN001
    """The kernel's descriptors are kept from step to step (tiered_plan.KernelPlan) and only
    their changing parts patched: through a schedule, a tensor that misses a step, a
    non-contiguous gradient, new betas and clip, a state tensor moved and a state replaced,
    every weight and state tensor equals the torch ops' (which make everything every step),
    and every statistic equals, bit for bit, the kernel's without kept descriptors."""
    models, opts = _pair(dtype, clip_update=1.0)
    models.append(small_model(dtype))
    torch.manual_seed(1)
    opts.append(build_optimizer(models[2], OptimConfig(name="tiered", lr=1e-2, clip_update=1.0)))
    (a, b, _), (oa, ob, oc) = models, opts
    for step in range(12):
        for model, opt in zip(models, opts, strict=True):
            set_grads(model, step)
            _changes(model, opt, step)
        before = oa._plan
        oc._plan = None  # made again at every step
        for opt in opts:
            opt.step()
        assert oa._plan is not None  # kept or made again at every step
        assert (oa._plan is before) == (step in (1, 9, 10, 11)), step  # kept unless changed
        assert oa.metrics() == oc.metrics(), step
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name
        for key, value in oa.state[p].items():
            other = ob.state[q][key]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
    counts = sorted(st["step"] for st in oa.state.values())
    assert counts[0] == 4 and counts[1] == 11 and counts[-1] == 12  # restarted; missed a step
    assert oa.metrics() == pytest.approx(ob.metrics(), rel=1e-12)


def test_a_weight_narrowed_at_its_address_is_checked_again(kernel) -> None:  # noqa: ANN001
    """A parameter replaced by a smaller view at the same address (and its gradient with it)
    after the descriptors were kept: they are not used (the kernel would read the old extent
    of the new gradient); the torch ops refuse the state of the old size by name."""
    model = torch.nn.Linear(64, 40, bias=False)
    opt = build_optimizer(model, OptimConfig(name="tiered"))
    model.weight.grad = torch.ones_like(model.weight)
    opt.step()
    opt.step()
    assert opt._plan is not None
    model.weight.data = model.weight.data[:20]
    model.weight.grad = torch.ones_like(model.weight)
    with pytest.raises(RuntimeError):
        opt.step()
