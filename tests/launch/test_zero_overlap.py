"""Communication that overlaps (issue 26), on 2 and 4 gloo ranks with plain SGD:

* ZeRO-1/2: the all-gathers after the step are left running, each waited for in a forward pre-hook of the first
  module holding one of its bucket's parameters; the losses equal the old path's (every gather waited for at once)
  bit for bit; ``state_dict`` right after the step sees the stepped values; a forward that reads a parameter outside
  its module fails loudly;
* ZeRO-0 under pp: the data-parallel owner (``DDPSync``, told that the runner defers) all-reduces the gradients in
  buckets, each stage's launched as the schedule reports its last backward, one all-reduce per bucket, with less
  extra memory than one copy of the gradients; ``finalize`` ends the step, and the losses equal a flat all-reduce's.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.harness import gloo_rank, spawn_reports

STEPS = 3


def _small_model() -> nn.Module:
    from lightning_par.examples.plain_lm import PlainLM

    torch.manual_seed(0)
    return PlainLM(vocab_size=64, dim=16, n_layers=2, n_heads=2, max_seq_len=8)


def _tokens(rank: int, world: int) -> torch.Tensor:
    tokens = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    return tokens[rank * 4 // world:(rank + 1) * 4 // world]


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())


# -- ZeRO-1/2: prefetched all-gathers --------------------------------------------------------------------------------
def _fit_zero(stage: int, prefetch: bool, mesh, rank: int, world: int) -> dict:
    from lightning_par.parallel import zero_state
    from lightning_par.parallel.zero import ZeroPartitioner

    model = _small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    part = ZeroPartitioner(model, [optimizer], mesh, stage, bucket_cap_mb=0.004, prefetch=prefetch)
    partitioner_hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    index = {id(b): i for i, b in enumerate(part.buckets)}
    holders: dict[str, set[int]] = {}  # module name -> buckets of the parameters it holds
    events: list[tuple[str, object]] = []
    for name, sub in model.named_modules():
        held = {index[id(part._bucket_of[id(p)][0])] for p in sub.parameters(recurse=False)}
        if held:
            holders[name] = held
            # registered after the partitioner's hook: runs after its wait
            sub.register_forward_pre_hook(lambda m, a, name=name: events.append(("forward", name)))
    wait = part._wait_gather

    def recorded(bucket):
        if bucket.gather is not None:
            events.append(("wait", index[id(bucket)]))
        wait(bucket)

    part._wait_gather = recorded
    losses, outstanding, first_uses_ok, states, changed = [], [], [], [], []
    for step in range(STEPS):
        events.clear()
        loss = _loss(model, _tokens(rank, world))
        loss.backward()
        part.finish_gradient_sync()
        if step and prefetch:  # the forward waited for each bucket just before the first module holding it ran
            waits = [e[1] for e in events if e[0] == "wait"]
            ok = sorted(waits) == list(range(len(part.buckets)))
            for bucket in range(len(part.buckets)):
                at = events.index(("wait", bucket))
                first = next(i for i, e in enumerate(events) if e[0] == "forward" and bucket in holders[e[1]])
                ok = ok and at < first and all(e[0] == "wait" for e in events[at + 1:first])
            first_uses_ok.append(ok)
        before = {k: v.detach().clone() for k, v in model.state_dict().items()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        part.gather_parameters()
        outstanding.append(part.gathers_outstanding)
        if step == STEPS - 1:  # a save right after the step: the state_dict hook waits for every gather
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            outstanding.append(part.gathers_outstanding)
            states = {k: v.flatten().tolist() for k, v in state.items()}
            changed = [k for k in state if not torch.equal(state[k], before[k])]
            saved = zero_state.model_state(model, part)
            assert saved  # the shards (masters): waited for too
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)
        losses.append(float(reduced) / world)
    part.remove()
    return {"partitioner_hooks": partitioner_hooks, "losses": losses, "outstanding": outstanding,
            "first_use_waits": first_uses_ok, "state": states,
            "changed": changed, "buckets": len(part.buckets), "params": len(list(model.parameters()))}


class _Peek(nn.Module):
    """Reads ``inner.weight`` in its own forward without calling ``inner``: outside the module that holds it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = nn.Linear(64, 64)
        self.out = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x @ self.inner.weight.t())


def _peek(prefetch: bool, mesh, warned: list[str]) -> str:
    from lightning_par.parallel.zero import ZeroPartitioner

    model = _Peek()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    part = ZeroPartitioner(model, [optimizer], mesh, 1, bucket_cap_mb=0.01, prefetch=prefetch)
    # an input that needs a gradient: autograd saves the weight it is multiplied with
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(2)).requires_grad_()
    try:
        for _ in range(2):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                y = model(x)
            warned.extend(str(w.message)[:60] for w in caught)
            y.square().mean().backward()
            part.finish_gradient_sync()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            part.gather_parameters()
    except RuntimeError as err:
        return f"RuntimeError: {err}"[:200]
    finally:
        part.wait_all()
    return "trained"


def _zero_worker(rank: int, world: int, store: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    with gloo_rank(rank, world, store, out) as report:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))["dp"]
        for stage in (1, 2):
            for prefetch in (False, True):
                report[f"zero{stage}_prefetch={prefetch}"] = _fit_zero(stage, prefetch, mesh, rank, world)
        report["peek_warnings=False"], report["peek_warnings=True"] = [], []
        report["peek_prefetch=False"] = _peek(False, mesh, report["peek_warnings=False"])
        report["peek_prefetch=True"] = _peek(True, mesh, report["peek_warnings=True"])


@pytest.fixture(scope="module")
def zero_reports(tmp_path_factory):
    return spawn_reports(_zero_worker, tmp_path_factory.mktemp("zero_overlap"), nprocs=2)


@pytest.mark.launch(ranks=2)
@pytest.mark.parametrize("stage", [1, 2])
def test_gathers_are_waited_in_the_forward_and_losses_are_exact(zero_reports, stage):
    for report in zero_reports:
        old, new = report[f"zero{stage}_prefetch=False"], report[f"zero{stage}_prefetch=True"]
        n = new["buckets"]
        print(f"zero{stage} dp2: {n} buckets for {new['params']} parameters; outstanding after each step's "
              f"gather: {new['outstanding'][:STEPS]} (old path: {old['outstanding'][:STEPS]}); losses {new['losses']}")
        assert n >= 4
        assert old["partitioner_hooks"] == 0 and new["partitioner_hooks"] > 0  # the default adds nothing per forward
        assert new["outstanding"] == [n] * STEPS + [0]  # all left running; state_dict waited for every one
        assert old["outstanding"] == [0] * (STEPS + 1)
        assert new["first_use_waits"] == [True] * (STEPS - 1)  # each bucket waited just before its first module
        assert new["losses"] == old["losses"]  # bit for bit
        assert new["losses"][-1] < new["losses"][0]
        # a save right after the step sees the stepped parameters, not the ones before it
        assert new["state"] == old["state"]
        assert len(new["changed"]) == new["params"]


@pytest.mark.launch(ranks=2)
def test_a_parameter_read_outside_its_module_fails_loudly(zero_reports):
    for report in zero_reports:
        assert report["peek_prefetch=False"] == "trained"
        assert "modified by an inplace operation" in report["peek_prefetch=True"], report["peek_prefetch=True"]
        assert report["peek_warnings=False"] == []
        assert report["peek_warnings=True"] == ["ZeRO prefetch: _Peek's forward ran no module holding ['inner"]


# -- ZeRO-0 under pp: bucketed all-reduce launched during the schedule -----------------------------------------------
PP_BATCH, MICRO = 8, 2


def _flat_all_reduce(runtime, group) -> None:
    """The old path: tied sum, then one flat all-reduce of every gradient (a copy of all of them)."""
    runtime.sum_tied_gradients()
    grads = [p.grad for p in runtime.module.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def _fit_pipeline(schedule: str, bucketed: bool, mesh) -> dict:
    from lightning_par.examples.gpt import GPT, GPTConfig
    from lightning_par.measure import CommCounter
    from lightning_par.parallel.finalize import finalize
    from lightning_par.parallel.gradient_sync import DDPSync
    from lightning_par.parallel.parts import split
    from lightning_par.parallel.pipeline.runtime import PipelineRuntime, resolve_schedule

    torch.manual_seed(0)
    # tied embedding and head: on the first and last stage, summed over the pipeline before they are reduced
    model = GPT(GPTConfig(vocab_size=64, dim=16, n_layers=4, n_heads=2, n_kv_heads=1, ffn_dim=32, max_seq_len=8,
                          tie_embeddings=True))
    runtime = PipelineRuntime(split(model, resolve_schedule(schedule, 2, MICRO), mesh["pp"]), mesh["pp"],
                              lambda y, t: nn.functional.cross_entropy(y.flatten(0, 1), t.flatten()),
                              loss_scale=1.0 / MICRO, device=torch.device("cpu"))
    group = mesh["dp"].get_group()
    owner = DDPSync(mesh["dp"], bucket_cap_mb=0.004, deferred=True)
    reported: list[int] = []  # stages whose gradients the schedule reported, this step
    if bucketed:
        owner.wrap(runtime.module)

        def heard(params) -> None:
            reported.append(1)
            owner.start_grad_sync(params)

        runtime.grad_sync_func = heard
    optimizer = torch.optim.SGD(runtime.module.parameters(), lr=0.2)
    dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    tokens = torch.randint(0, 64, (PP_BATCH, 8), generator=torch.Generator().manual_seed(1))
    tokens = tokens[dp_rank * PP_BATCH // dp:(dp_rank + 1) * PP_BATCH // dp]
    losses, launched_in_schedule, all_reduces, buckets = [], [], [], []
    grad_bytes = 0
    original = dist.all_reduce
    seen: list[int] = []

    def all_reduce(tensor, *args, **kwargs):  # the dp group's, told apart from the pipeline group's (same size)
        if kwargs.get("group") is group:
            seen.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        before = owner.reducer.buckets_launched if bucketed else 0
        reported.clear()
        seen.clear()
        dist.all_reduce = all_reduce
        try:
            with CommCounter() as counter:
                loss = runtime.train_step(tokens, tokens)
                launched_in_schedule.append(len(reported))
                if bucketed:
                    finalize(owner, runtime)
                else:
                    _flat_all_reduce(runtime, group)
        finally:
            dist.all_reduce = original
        # CommCounter sees them too (it wraps the function it finds, here the counting one), among the pipeline's
        assert sum(1 for r in counter.records if r.kind == "all_reduce") >= len(seen)
        all_reduces.append(len(seen))
        buckets.append(owner.reducer.buckets_launched - before if bucketed else 1)
        grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in runtime.module.parameters()
                         if p.grad is not None)
        optimizer.step()
        losses.append(float(loss))
    return {"losses": losses, "launched_in_schedule": launched_in_schedule, "all_reduces": all_reduces,
            "buckets": buckets, "grad_bytes": grad_bytes, "stages": list(runtime.stage_ids),
            "peak_buffer_bytes": owner.reducer.peak_buffer_bytes if bucketed else grad_bytes}


def _pipeline_worker(rank: int, world: int, store: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    with gloo_rank(rank, world, store, out) as report:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        for schedule in ("1f1b", "zero_bubble"):
            for bucketed in (False, True):
                report[f"{schedule}_bucketed={bucketed}"] = _fit_pipeline(schedule, bucketed, mesh)


@pytest.fixture(scope="module")
def pipeline_reports(tmp_path_factory):
    return spawn_reports(_pipeline_worker, tmp_path_factory.mktemp("pp_dp_reduce"), nprocs=4)


@pytest.mark.launch(ranks=4)
@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_pipeline_zero0_reduces_in_buckets_during_the_schedule(pipeline_reports, schedule):
    for rank, report in enumerate(pipeline_reports):
        flat, bucketed = report[f"{schedule}_bucketed=False"], report[f"{schedule}_bucketed=True"]
        print(f"pp2 x dp2 {schedule} rank {rank}: {bucketed['buckets'][0]} buckets = {bucketed['all_reduces'][0]} "
              f"dp all-reduces per step (flat: {flat['all_reduces'][0]}); peak bucket buffers "
              f"{bucketed['peak_buffer_bytes']} B for {bucketed['grad_bytes']} B of gradients")
        assert flat["all_reduces"] == [1] * STEPS
        assert bucketed["buckets"][0] >= 3
        assert bucketed["all_reduces"] == bucketed["buckets"]  # one all-reduce per bucket
        assert bucketed["launched_in_schedule"] == [len(bucketed["stages"])] * STEPS  # launched by the schedule
        assert 0 < bucketed["peak_buffer_bytes"] < bucketed["grad_bytes"] / 2  # no copy of every gradient
        assert bucketed["losses"] == flat["losses"]  # bit for bit
        assert bucketed["losses"][-1] < bucketed["losses"][0]
