"""Tensor parallelism inside a pipeline stage (issue 10): a stage holds only some units, so plan patterns naming
the others are skipped with ``stage=True``; the whole model is checked once, strictly, by ``check_tp_plan``."""

import copy
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_par import LayoutError
from lightning_par.examples.gpt import GPT, GPTConfig, causal_lm_loss
from lightning_par.parallel.pipeline.split import RemovedUnit, plan_stages, rank_module
from lightning_par.parallel.tensor_parallel import check_tp_plan, resolve_tp_plan
from tests.harness import spawn


def _stages(tie: bool = False, n_stages: int = 2):
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("tiny", n_layers=4, tie_embeddings=tie))
    units = plan_stages(model, n_stages)
    return model, units, [rank_module(copy.deepcopy(model), units, [i]) for i in range(n_stages)]


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_each_stage_accepted_with_stage_option_refused_without(sequence_parallel):
    model, units, stages = _stages()
    assert units[0][0] == "embed" and units[-1][-1] == "head"
    whole = check_tp_plan(model, 2, sequence_parallel)
    assert whole == resolve_tp_plan(model, 2, sequence_parallel)  # check_tp_plan is the strict default
    missing = {0: "head", 1: "embed"}
    merged = {}
    for i, stage in enumerate(stages):
        with pytest.raises(LayoutError, match=f"GPT.tp_plan names '{missing[i]}', but GPT has no module of that name"):
            resolve_tp_plan(stage, 2, sequence_parallel)
        plan = resolve_tp_plan(stage, 2, sequence_parallel, stage=True)
        assert missing[i] not in plan
        merged.update(plan)
    # the stages' plans together are the whole model's plan: nothing lost, nothing added
    assert merged == whole


def test_stage_option_keeps_the_other_checks():
    model, _, stages = _stages()
    with pytest.raises(LayoutError, match="tp=3 does not divide"):
        resolve_tp_plan(stages[1], 3, stage=True)
    with pytest.raises(LayoutError, match="tp=3 does not divide"):
        check_tp_plan(model, 3)
    stage = stages[1]
    stage.tp_plan = {**GPT.tp_plan, "layers.*.mlp.up_proj": "no_such_style"}
    with pytest.raises(LayoutError, match="is not a style"):
        resolve_tp_plan(stage, 2, stage=True)
    tied, _, tied_stages = _stages(tie=True)
    tied.tp_plan = {**GPT.tp_plan, "head": "rowwise"}
    with pytest.raises(LayoutError, match="tied parameter"):
        check_tp_plan(tied, 2)
    # a pattern matching nothing in the whole model stays an error by default
    model.tp_plan = {**GPT.tp_plan, "layers.*.mlp.gate": "colwise"}
    with pytest.raises(LayoutError, match="names 'layers.\\*.mlp.gate'"):
        check_tp_plan(model, 2)
    for stage in tied_stages:  # tied embedding and head on different stages: each stage is fine on its own
        resolve_tp_plan(stage, 2, stage=True)


def test_removed_unit_stand_in_is_not_matched():
    _, units, stages = _stages()
    stage = stages[0]
    stage.head = RemovedUnit("head")  # a model without pipeline_units() gets a parameter-free stand-in
    with pytest.raises(LayoutError, match="names 'head', but GPT has no module of that name"):
        resolve_tp_plan(stage, 2)
    assert "head" not in resolve_tp_plan(stage, 2, stage=True)


def _worker(rank: int, store: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from lightning_par.parallel.tensor_parallel import apply_tensor_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    report = {}
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        for sp in (False, True):
            model, _, (s0, s1) = _stages()
            check_tp_plan(model, 2, sp)
            p0 = apply_tensor_parallel(s0, mesh, sp, stage=True)
            p1 = apply_tensor_parallel(s1, mesh, sp, stage=True)
            torch.manual_seed(1)
            x, y = torch.randint(0, 256, (4, 16)), torch.randint(0, 256, (4, 16))
            ref_loss = causal_lm_loss(model(x), y)
            ref_loss.backward()
            # as the engine does: every rank wraps the whole schedule step (both stages here) in the head's context;
            # stage 0 (no head) runs forward and backward inside loss_parallel, its own context is a no-op
            with p0.loss_context(), p1.loss_context():
                hidden = s0(x)
                logits = s1(hidden)
                loss = causal_lm_loss(logits, y)
                loss.backward()
            sharded_logits = isinstance(logits, DTensor)
            outside = s1(s0(x))  # outside the context: full logits
            grads = {}
            for stage in (s0, s1):
                for name, p in stage.named_parameters():
                    g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                    ref = model.get_parameter(name).grad
                    grads[name] = float((g - ref).abs().max() / ref.abs().max())
            report[f"sp={sp}"] = {
                "vocab_head": [p0.vocab_parallel_head, p1.vocab_parallel_head],
                "loss": float(loss.detach()), "ref_loss": float(ref_loss.detach()), "sharded_logits": sharded_logits,
                "hidden_len": hidden.shape[1],
                "outside_full": (not isinstance(outside, DTensor)) and tuple(outside.shape) == (4, 16, 256),
                "max_grad_rel": max(grads.values()), "n_grads": len(grads),
            }
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))


@pytest.mark.launch(ranks=2)
def test_tp_stages_match_one_process(tmp_path):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    spawn(_worker, (str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for sp, r in report.items():
            print(rank, sp, r)
            assert r["vocab_head"] == [False, True]
            assert r["sharded_logits"] and r["outside_full"]
            assert r["hidden_len"] == (8 if sp == "sp=True" else 16)  # a sequence shard passes between stages
            assert abs(r["loss"] - r["ref_loss"]) <= 1e-5 * abs(r["ref_loss"])
            assert r["n_grads"] == len(list(GPT(GPTConfig.from_preset("tiny", n_layers=4)).parameters()))
            assert r["max_grad_rel"] <= 1e-4
