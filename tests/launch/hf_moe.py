"""Hugging Face mixture-of-experts models (tiny configs of transformers' own classes, no download) trained through
``Trainer.fit`` -- tp2 from the model's own plan (``moe_tp_experts``), ZeRO-3 over dp2, a 2-stage pipeline, and
expert parallel from the model's own ep plan (ep2, with dp2 or tp2 on 4 ranks, inside a 2-stage pipeline on 4 or 8
ranks, with cp2 on 2) -- next to one process on the same batches.

Run under torchrun (``tests.harness.launch_matrix``) on 2 ranks (the styles and the refusals too) or 4;
``tests/launch/test_hf_moe.py`` reads what it writes.
Rank 0 also trains the reference: the same module and seed in one process, ``self.model(**batch).loss`` on the whole
batch -- with the router's load-balancing loss on, the model's loss includes ``router_aux_loss_coef`` times that loss
over all layers' router logits of the whole batch, which tp (it does not split tokens) must match exactly. Under
expert parallel each rank's forward sees its own share of the batch, so the reference's loss is the mean of the
model's loss on each share (:func:`reference` with ``chunks``).

The error cases run a fit that must be refused at setup, and record what each rank raised.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from tests.harness import case_or_error, close_process_group, every_ranks_error
from tests.launch.pipeline_any_model import corpus_blocks

SEED = 1234
STEPS = 6
BATCH = 8
MICROBATCHES = 4
RESUME_EPOCH = STEPS // 2  # batches per epoch of a resumed case: two epochs make the STEPS steps
AUX_COEF = 0.05  # large enough that the load-balancing term moves the loss well beyond the parity tolerance
#: under expert parallel: large enough that the per-rank loss is another function than the whole batch's, beyond the
#: tolerance (at 0.05 the two differ by only ~1e-5 on qwen3_moe; at 0.2 by 1e-3 or more, and SGD still learns)
EP_AUX_COEF = 0.2
LR = {"sgd": 0.2, "adamw": 3e-3}  # (SGD at 0.3 already makes these tiny models' losses jump after step 3)
#: arch -> its causal LM class in transformers
ARCHS = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
         "qwen2_moe": "Qwen2MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}
#: expert parallel also trains gpt-oss (its experts transposed, gate|up interleaved, with biases: no tp plan applies)
EP_ARCHS = {**ARCHS, "gpt_oss": "GptOssForCausalLM"}


def moe_config(arch: str, aux: bool | float):
    """A tiny config of ``arch``: 2 layers, 4 experts of which each token takes 2, its experts' weights large enough
    (4 x 64 x 64) to be built deferred (on the meta device) and materialised per rank."""
    import transformers

    common = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, num_experts_per_tok=2, output_router_logits=bool(aux),
                  router_aux_loss_coef=aux_coef(aux))
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                                           head_dim=16)
    if arch == "mixtral":
        return transformers.MixtralConfig(**common, intermediate_size=32, num_local_experts=4)
    if arch == "qwen2_moe":  # a gated shared expert beside the routed ones
        return transformers.Qwen2MoeConfig(**common, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                                           shared_expert_intermediate_size=64)
    if arch == "olmoe":  # q/k norms over all heads: its plan gathers q, k and v
        return transformers.OlmoeConfig(**common, intermediate_size=32, num_experts=4, eos_token_id=None)
    if arch == "deepseek_v3":  # a dense first layer, shared experts, grouped top-k routing, MLA attention
        return transformers.DeepseekV3Config(**common, intermediate_size=128, moe_intermediate_size=32,
                                             n_routed_experts=4, n_group=2, topk_group=1, first_k_dense_replace=1,
                                             n_shared_experts=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
                                             qk_nope_head_dim=8, v_head_dim=16)
    if arch == "gpt_oss":  # biases in its experts, its own clamped activation, attention sinks, sliding windows
        return transformers.GptOssConfig(**common, intermediate_size=32, num_local_experts=4, head_dim=16,
                                         sliding_window=16)
    raise ValueError(f"unknown arch {arch!r}; use one of {list(EP_ARCHS)}")


#: the experts' tensor-parallel split transformers published in these models' plans up to 5.17 (at least); later
#: releases leave the experts to expert parallel (replicated under tp). The tests declare it on the instance where the
#: installed plan lacks it, as a user may (``model.tp_plan = {...}``), so every release of the range tests the split
EXPERTS_TP_PLAN = {"model.layers.*.mlp.experts.gate_up_proj": "packed_colwise",
                   "model.layers.*.mlp.experts.down_proj": "rowwise", "model.layers.*.mlp.experts": "moe_tp_experts"}


def aux_coef(aux: bool | float) -> float:
    """The load-balancing coefficient of a case's ``aux``: off, :data:`AUX_COEF`, or the coefficient given."""
    return 0.0 if not aux else AUX_COEF if aux is True else float(aux)


def moe_model(arch: str, aux: bool | float = False) -> torch.nn.Module:
    """The tiny ``arch`` model, its weights drawn from :data:`SEED`."""
    import transformers

    config = moe_config(arch, aux)
    torch.manual_seed(SEED)
    model = getattr(transformers, EP_ARCHS[arch])(config)
    if arch in ARCHS and "moe_tp_experts" not in model.tp_plan.values():
        model.tp_plan = {**model.tp_plan, **EXPERTS_TP_PLAN}
    return model


class HFMoELM(L.LightningModule):
    """A tiny Hugging Face MoE causal LM trained as its documentation shows: dict batches, ``self.model(**batch)
    .loss`` (with ``aux``, the load-balancing loss included by the model itself). Built in ``configure_model`` from a
    fixed seed, as a user's model would be under a layout that builds it deferred."""

    def __init__(self, arch: str = "qwen3_moe", optimizer: str = "sgd", aux: bool | float = False):
        super().__init__()
        self.arch, self.optimizer, self.aux = arch, optimizer, aux
        self.model = None

    def configure_model(self):
        if self.model is None:
            self.model = moe_model(self.arch, self.aux)

    def training_step(self, batch, batch_idx):
        out = self.model(**batch)
        self.log("train/loss", out.loss, batch_size=batch["input_ids"].size(0), sync_dist=True)
        return out.loss

    def configure_optimizers(self):
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=LR["sgd"])
        return torch.optim.AdamW(self.parameters(), lr=LR["adamw"], weight_decay=0.1)


@dataclass(frozen=True)
class Case:
    arch: str
    optimizer: str
    layout: dict[str, Any] = field(default_factory=lambda: {"tp": 2})  # tp / zero_stage / pp / ep: which strategy
    aux: bool | float = False  # the load-balancing loss: off, on at AUX_COEF, or on at this coefficient
    full: bool = False  # in the full run only (pytest --full)
    world: int = 2
    resume: bool = False  # one epoch of 3 batches, then a second one resumed from its checkpoint in a new Trainer
    scope: str | None = None  # the strategy's aux_loss_scope ("global": the reference is one process, whole batches)


CASES: dict[str, Case] = {
    # the default set: one launch
    "qwen3_moe_tp2_sgd_aux": Case("qwen3_moe", "sgd", aux=True),
    "mixtral_tp2_adamw": Case("mixtral", "adamw"),
    # the full set
    "qwen3_moe_tp2_sgd": Case("qwen3_moe", "sgd", full=True),
    "qwen3_moe_tp2_adamw": Case("qwen3_moe", "adamw", full=True),
    "qwen3_moe_tp2_adamw_aux": Case("qwen3_moe", "adamw", aux=True, full=True),
    "mixtral_tp2_sgd": Case("mixtral", "sgd", full=True),
    "mixtral_tp2_sgd_aux": Case("mixtral", "sgd", aux=True, full=True),
    "mixtral_tp2_adamw_aux": Case("mixtral", "adamw", aux=True, full=True),
    "deepseek_v3_tp2_sgd": Case("deepseek_v3", "sgd", full=True),
    "deepseek_v3_tp2_adamw": Case("deepseek_v3", "adamw", full=True),
    "qwen3_moe_zero3_dp2_adamw": Case("qwen3_moe", "adamw", {"zero_stage": 3}, full=True),
    "mixtral_zero3_dp2_sgd": Case("mixtral", "sgd", {"zero_stage": 3}, full=True),
    "qwen3_moe_pp2_1f1b_sgd": Case("qwen3_moe", "sgd", {"pp": 2}, full=True),
    "mixtral_pp2_1f1b_adamw": Case("mixtral", "adamw", {"pp": 2}, full=True),
    "qwen3_moe_tp2_adamw_resumed": Case("qwen3_moe", "adamw", aux=True, full=True, resume=True),
    # 4 ranks: the experts split over tp in each of two replicas, or on each of two stages
    "qwen3_moe_dp2_tp2_adamw": Case("qwen3_moe", "adamw", {"tp": 2, "dp": 2}, full=True, world=4),
    "mixtral_tp2_pp2_1f1b_sgd": Case("mixtral", "sgd", {"tp": 2, "pp": 2}, full=True, world=4),
    # expert parallel from the model's own ep plan: each rank 2 of the 4 experts, its own tokens (the default set: one)
    "qwen3_moe_ep2_sgd_aux": Case("qwen3_moe", "sgd", {"ep": 2}, aux=EP_AUX_COEF),
    **{f"{arch}_ep2_{opt}{'_aux' * aux}": Case(arch, opt, {"ep": 2}, aux=EP_AUX_COEF * aux, full=True)
       for arch in ("qwen3_moe", "mixtral") for opt in ("sgd", "adamw") for aux in (False, True)
       if (arch, opt, aux) != ("qwen3_moe", "sgd", True)},
    "deepseek_v3_ep2_sgd": Case("deepseek_v3", "sgd", {"ep": 2}, full=True),  # (routes without a balancing loss)
    "deepseek_v3_ep2_adamw": Case("deepseek_v3", "adamw", {"ep": 2}, full=True),
    "qwen2_moe_ep2_adamw_aux": Case("qwen2_moe", "adamw", {"ep": 2}, aux=EP_AUX_COEF, full=True),
    "olmoe_ep2_sgd_aux": Case("olmoe", "sgd", {"ep": 2}, aux=EP_AUX_COEF, full=True),
    "gpt_oss_ep2_adamw_aux": Case("gpt_oss", "adamw", {"ep": 2}, aux=EP_AUX_COEF, full=True),
    "mixtral_ep2_zero3_sgd_aux": Case("mixtral", "sgd", {"ep": 2, "zero_stage": 3}, aux=EP_AUX_COEF, full=True),
    # 4 ranks: ep2 x dp2 at ZeRO-1 and ZeRO-3 (each expert on 2 ranks); ep2 beside tp2 on attention at ZeRO-1
    "qwen3_moe_ep2_dp2_zero3_adamw_aux": Case("qwen3_moe", "adamw", {"ep": 2, "zero_stage": 3}, aux=EP_AUX_COEF,
                                              full=True, world=4),
    "mixtral_ep2_dp2_zero1_adamw_aux": Case("mixtral", "adamw", {"ep": 2, "zero_stage": 1}, aux=EP_AUX_COEF,
                                            full=True, world=4),
    "qwen3_moe_ep2_tp2_zero1_sgd_aux": Case("qwen3_moe", "sgd", {"ep": 2, "tp": 2, "zero_stage": 1}, aux=EP_AUX_COEF,
                                            full=True, world=4),
    "deepseek_v3_ep2_tp2_zero1_adamw": Case("deepseek_v3", "adamw", {"ep": 2, "tp": 2, "zero_stage": 1}, full=True,
                                            world=4),
    # expert parallel inside a pipeline (4 ranks: ep2 over the dp2 ranks of each stage), under 1F1B and ZBV; the
    # load-balancing loss stays off (under pp it is each layer's term, another function than the model's own)
    **{f"{arch}_ep2_pp2_{schedule}_sgd": Case(arch, "sgd", {"ep": 2, "pp": 2, "schedule": schedule}, full=True, world=4)
       for arch in ("qwen3_moe", "mixtral", "deepseek_v3") for schedule in ("1f1b", "zbv")},
    "qwen3_moe_ep2_pp2_1f1b_adamw": Case("qwen3_moe", "adamw", {"ep": 2, "pp": 2, "schedule": "1f1b"}, full=True,
                                         world=4),
    # 8 ranks: dp2 x tp2 x pp2, the experts over ep2 of the dp ranks, attention from the tp plan
    "qwen3_moe_dp2_tp2_pp2_ep2_sgd": Case("qwen3_moe", "sgd", {"ep": 2, "tp": 2, "pp": 2, "schedule": "1f1b"},
                                          full=True, world=8),
    # expert parallel with context parallel (2 ranks: cp2, the experts over the cp ranks of the one replica)
    **{f"{arch}_ep2_cp2_sgd": Case(arch, "sgd", {"ep": 2, "cp": 2}, full=True)
       for arch in ("qwen3_moe", "mixtral", "deepseek_v3")},
    # ... with the load-balancing loss: each cp rank computes it on the tokens it holds (reference: cp_aux_loss)
    "qwen3_moe_ep2_cp2_sgd_aux": Case("qwen3_moe", "sgd", {"ep": 2, "cp": 2}, aux=EP_AUX_COEF, full=True),
    "mixtral_ep2_cp2_adamw_aux": Case("mixtral", "adamw", {"ep": 2, "cp": 2}, aux=EP_AUX_COEF, full=True),
    # the global scope: the routers' statistics summed over the dp x cp ranks, so each step's loss is one process's on
    # whole batches (the default set: one)
    "qwen3_moe_ep2_sgd_global": Case("qwen3_moe", "sgd", {"ep": 2}, aux=EP_AUX_COEF, scope="global"),
    **{f"{arch}_ep2_{opt}_global": Case(arch, opt, {"ep": 2}, aux=EP_AUX_COEF, scope="global", full=True)
       for arch, opt in (("qwen3_moe", "adamw"), ("mixtral", "sgd"), ("qwen2_moe", "adamw"), ("olmoe", "sgd"),
                         ("gpt_oss", "adamw"))},
    "qwen3_moe_zero1_dp2_sgd_global": Case("qwen3_moe", "sgd", {"zero_stage": 1}, aux=EP_AUX_COEF, scope="global",
                                           full=True),
    "mixtral_ep2_cp2_sgd_global": Case("mixtral", "sgd", {"ep": 2, "cp": 2}, aux=EP_AUX_COEF, scope="global",
                                       full=True),
    "qwen3_moe_ep2_dp2_zero3_adamw_global": Case("qwen3_moe", "adamw", {"ep": 2, "zero_stage": 3}, aux=EP_AUX_COEF,
                                                 scope="global", full=True, world=4),
    "mixtral_ep2_tp2_zero1_sgd_global": Case("mixtral", "sgd", {"ep": 2, "tp": 2, "zero_stage": 1}, aux=EP_AUX_COEF,
                                             scope="global", full=True, world=4),
}
#: fits that must be refused at setup: (case, strategy options, the start of the error every rank must raise)
ERROR_CASES: dict[str, tuple[Case, dict[str, Any], str]] = {
    "packed_experts_under_zero1": (
        Case("qwen3_moe", "sgd"), {"tp": 2, "zero_stage": 1},
        "LayoutError: model.model.layers.0.mlp.experts is planned 'moe_tp_experts:gate_up_proj=packed_colwise,"
        "down_proj=rowwise', which zero_stage=1 cannot shard yet"),
    # (under pp the loss is each layer's term on its stage, tests/launch/test_pipeline_hf_loss.py; the global scope
    # is not built there)
    "load_balancing_loss_global_under_pp": (
        Case("mixtral", "sgd", aux=True), {"pp": 2, "aux_loss_scope": "global"},
        "LayoutError: aux_loss_scope='global' with pipeline parallel: MixtralForCausalLM's load-balancing loss is "
        "formed layer by layer on each stage under pp"),
    "global_scope_without_a_balancing_loss": (
        Case("deepseek_v3", "sgd"), {"ep": 2, "aux_loss_scope": "global"},
        "LayoutError: aux_loss_scope='global' but HFMoELM has no router whose load-balancing loss it could scope"),
}


def make_rows(n_batches: int) -> list[dict[str, torch.Tensor]]:
    """``n_batches * BATCH`` rows of real text; every token counted (no padding), so a rank's mean over its half of a
    batch averages with the other's into the whole batch's mean."""
    return [{"input_ids": ids, "labels": ids.clone()} for ids in corpus_blocks(n_batches * BATCH)]


def batches_of(rows: list[dict]) -> list[dict[str, torch.Tensor]]:
    return [{k: torch.stack([r[k] for r in rows[i:i + BATCH]]) for k in rows[0]} for i in range(0, len(rows), BATCH)]


def reference(case: Case, train: list[dict], chunks: int = 1, cp: int = 1) -> dict:
    """One process: the module's own step on whole batches, its optimizer; the load-balancing term of each step.
    ``chunks``: the loss is the mean of the model's loss on each data-parallel rank's share of the batch (rows r,
    r + chunks, ...), as each rank's forward computes it -- the per-rank load-balancing loss's semantics. ``cp``:
    the same within a row, whose tokens are split over the cp ranks: the language-model loss of whole sequences
    plus the mean over the cp ranks of the load-balancing loss of the tokens each holds (:func:`cp_aux_loss`; the
    logged loss is averaged over dp x cp, so it is that mean too)."""
    lm = HFMoELM(case.arch, case.optimizer, case.aux)
    lm.configure_model()
    optimizer = lm.configure_optimizers()
    losses, aux = [], []
    for batch in train:
        outs = [lm.model(**{k: v[r::chunks] for k, v in batch.items()}) for r in range(chunks)]
        if cp > 1 and case.aux:
            coef = aux_coef(case.aux)
            for out in outs:  # the model's term on whole sequences replaced by the cp ranks' mean (or the global one)
                shards = cp_aux_loss(lm.model, out.router_logits, batch["input_ids"].size(1), cp,
                                     together=case.scope == "global").mean()
                out.loss, out.aux_loss = out.loss - coef * out.aux_loss + coef * shards, shards
        loss = sum(out.loss for out in outs) / chunks
        loss.backward()
        losses.append(loss.item())
        aux.append(aux_coef(case.aux) * sum(out.aux_loss.item() for out in outs) / chunks if case.aux else 0.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {"losses": losses, "aux_terms": aux}


def cp_aux_loss(model: torch.nn.Module, router_logits: tuple[torch.Tensor, ...], length: int, cp: int,
                together: bool = False) -> torch.Tensor:
    """The model's own load-balancing loss of the tokens each of the ``cp`` ranks holds under context parallel
    (sequence chunks r and 2 cp - 1 - r of 2 cp; a last token of an odd length is dropped), from the router logits of
    whole sequences (``[rows x length, experts]`` per layer: a token's logits do not depend on how the sequence is
    split); ``together``: one loss of all the tokens the cp ranks hold (the global scope's)."""
    import sys

    balance = sys.modules[type(model).__module__].load_balancing_loss_func
    config, chunk = model.config, length // (2 * cp)
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    per_rank = []
    for r in range(1 if together else cp):
        chunks = range(2 * cp) if together else (r, 2 * cp - 1 - r)
        held = torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in chunks])
        shard = tuple(logits.view(-1, length, logits.size(-1))[:, held].reshape(-1, logits.size(-1))
                      for logits in router_logits)
        per_rank.append(balance(shard, experts, config.num_experts_per_tok))
    return torch.stack(per_rank)


class _Record(L.Callback):
    def __init__(self):
        self.train: list[float] = []
        self.placements: dict[str, str] = {}
        self.expert_bytes: dict[str, int] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.train.append(float(trainer.callback_metrics["train/loss"]))
        if not self.placements:  # how the first MoE layer's experts are held
            from torch.distributed.tensor import DTensor

            for name, param in pl_module.named_parameters():
                if ".mlp.experts." in name and isinstance(param, DTensor):
                    self.placements[name.split(".mlp.experts.")[1]] = (
                        f"{param.placements} local {tuple(param.to_local().shape)} of {tuple(param.shape)}")
            self.expert_bytes = expert_bytes(pl_module, trainer.optimizers[0], trainer.strategy)


def expert_bytes(module: torch.nn.Module, optimizer: torch.optim.Optimizer, strategy: Any) -> dict[str, int]:
    """The bytes of the experts' parameters on this rank and in all, and of their optimizer state on this rank (under
    ZeRO-1/2 the optimizer steps the expert partitioner's shards of them)."""
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    params = [p for n, p in module.named_parameters() if ".mlp.experts." in n]
    partitioner = getattr(getattr(strategy, "gradient_sync", None), "expert_partitioner", None)
    stepped = params if partitioner is None else [b.shard for b in partitioner.buckets]
    states = [v for p in stepped for v in optimizer.state.get(p, {}).values()
              if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {"held": sum(local(p).nbytes for p in params), "total": sum(p.numel() * p.element_size() for p in params),
            "state": sum(local(v).nbytes for v in states), "states": len(states)}


def strategy_for(layout: dict[str, Any], heartbeat: bool = True):
    from lightning_par import Hybrid3DStrategy, LayoutStrategy, MegatronTPStrategy, PipelineStrategy, ZeroStrategy

    options: dict[str, Any] = {} if heartbeat else {"heartbeat_timeout": None}
    if "aux_loss_scope" in layout:
        layout = dict(layout)
        options["aux_loss_scope"] = layout.pop("aux_loss_scope")
    if "ep" in layout and ("pp" in layout or "cp" in layout):
        return LayoutStrategy(**layout, **({"n_microbatches": MICROBATCHES} if "pp" in layout else {}), **options)
    if "ep" in layout:  # the experts from the model's own ep plan; with tp, attention from its tp plan
        return LayoutStrategy(**layout, **options) if "tp" in layout else \
            ZeroStrategy(stage=layout.get("zero_stage", 0), ep=layout["ep"], **options)
    if "pp" in layout:
        pipeline = dict(schedule="1f1b", n_microbatches=MICROBATCHES, **options)
        if "tp" in layout:  # (ZeRO-0: its default ZeRO-1 refuses packed expert weights)
            return Hybrid3DStrategy(**layout, zero_stage=0, **pipeline)
        return PipelineStrategy(pp=layout["pp"], **pipeline)
    if "tp" in layout:
        return MegatronTPStrategy(**layout, **options)
    return ZeroStrategy(stage=layout["zero_stage"], **options)


def fit(case: Case, rows: list[dict], root: Path, layout: dict[str, Any] | None = None,
        heartbeat: bool = True, epochs: int = 1, ckpt_path: str | None = None) -> _Record:
    """``Trainer.fit`` of ``case`` on ``rows``, one replica's share of each batch per rank; with ``epochs``, epochs of
    all ``rows`` (a checkpoint in ``root / "ckpt"`` at each end), continuing from ``ckpt_path`` if given."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    layout = layout or {**case.layout, **({"aux_loss_scope": case.scope} if case.scope else {})}
    world, tp, cp = dist.get_world_size(), layout.get("tp", 1), layout.get("cp", 1)
    dp = world // (tp * cp * layout.get("pp", 1))
    dp_rank = dist.get_rank() // (tp * cp) % dp  # (the mesh is (pp, dp, cp, tp), tp innermost; cp ranks share rows)
    record = _Record()
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy_for(layout, heartbeat), max_epochs=epochs,
        limit_train_batches=STEPS, num_sanity_val_steps=0,
        use_distributed_sampler=False,  # (Lightning's injected sampler shuffles a training loader)
        logger=False, enable_checkpointing=case.resume, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[record, *([ModelCheckpoint(dirpath=root / "ckpt", save_top_k=-1)] if case.resume else [])],
        default_root_dir=root,
    )
    # replica r takes rows r, r + dp, ...: its share of each batch of one process
    loader = torch.utils.data.DataLoader(rows[dp_rank::dp], batch_size=BATCH // dp, shuffle=False)
    trainer.fit(HFMoELM(case.arch, case.optimizer, case.aux), loader, ckpt_path=ckpt_path)
    return record


def _train(case: Case, rows: list[dict], root: Path) -> tuple[list[float], dict]:
    """One case's fit (or fit and resume): its per-step losses, and how this rank holds the experts."""
    if case.resume:
        return fit_and_resume(case, rows[:RESUME_EPOCH * BATCH], root), {}
    record = fit(case, rows, root)
    return record.train, {**record.placements, "bytes": record.expert_bytes}


def fit_and_resume(case: Case, rows: list[dict], root: Path) -> list[float]:
    """Two epochs of ``rows``: the first in one fit, which saves its checkpoint; the second in another Trainer with a
    new model, resumed from it (the experts' split weights and their optimizer states through DCP)."""
    first = fit(case, rows, root)
    dist.barrier()
    (ckpt,) = sorted((root / "ckpt").glob(f"*step={len(rows) // BATCH}.ckpt"))
    second = fit(case, rows, root, epochs=2, ckpt_path=str(ckpt))
    return first.train + second.train


class UserExperts(torch.nn.Module):
    """Experts written as a user would, in transformers' layout ([experts, out, in], gate|up fused)."""

    def __init__(self, n_experts: int = 4, hidden: int = 16, inter: int = 8):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(n_experts, 2 * inter, hidden) / hidden ** 0.5)
        self.down_proj = torch.nn.Parameter(torch.randn(n_experts, hidden, inter) / inter ** 0.5)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = torch.nn.functional.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        return torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, self.down_proj[e])

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for k in range(top_k_index.size(1)):
            for e in range(self.gate_up_proj.size(0)):
                rows = top_k_index[:, k] == e
                out[rows] += top_k_weights[rows, k, None] * self.expert(e, hidden_states[rows])
        return out


class SquashedExperts(UserExperts):
    """The same with each expert's output squashed after down (tanh): not a sum of the ranks' slices."""

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(super().expert(e, x))


class UserMoE(torch.nn.Module):
    """A plain PyTorch MoE layer (a top-2 router and experts) declaring transformers' plan for its experts."""

    tp_plan = {"experts.gate_up_proj": "packed_colwise", "experts.down_proj": "rowwise", "experts": "moe_tp_experts"}

    def __init__(self, experts: torch.nn.Module):
        super().__init__()
        self.router = torch.nn.Linear(16, 4, bias=False)
        self.experts = experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, index = self.router(x).softmax(dim=-1).topk(2, dim=-1)
        return self.experts(x, index, weights)


def user_experts(tp_mesh) -> dict:
    """The experts self-check at setup on a user's MoE: correct experts pass it and match one process (output and
    gradients); experts squashing their output after down are refused by name."""
    from torch.distributed.tensor import DTensor

    from lightning_par import LayoutError
    from lightning_par.parallel.tensor_parallel import apply_tensor_parallel

    torch.manual_seed(SEED)
    reference = UserMoE(UserExperts())
    split = UserMoE(UserExperts())
    split.load_state_dict(reference.state_dict())
    apply_tensor_parallel(split, tp_mesh)
    x = torch.randn(16, 16)
    (reference(x) ** 2).sum().backward()
    (split(x) ** 2).sum().backward()
    worst = max(float(((p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) - r.grad).abs().max()
                      / r.grad.abs().max()) for p, r in zip(split.parameters(), reference.parameters(), strict=True))
    error = None
    try:
        apply_tensor_parallel(UserMoE(SquashedExperts()), tp_mesh)
    except LayoutError as refused:
        error = str(refused)
    return {"grad_rel": worst, "squashed_error": error}


def styles(tp_mesh, out_dir: Path) -> dict[str, dict]:
    """The styles alone, without Lightning: each published MoE plan applied by ``apply_tensor_parallel`` on 2 ranks,
    one forward and backward with the load-balancing loss on (DeepSeek-V3 has none), against one process: the loss,
    every gradient, the global gradient norm (what clipping uses), what rank r holds of the first MoE layer's experts
    (its slices of the one-process tensors), and a DCP checkpoint of the split model read back as one process's
    state dict."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.tensor import DTensor

    from lightning_par.parallel.grad_norm import global_grad_norm
    from lightning_par.parallel.tensor_parallel import apply_tensor_parallel, packed_as_slices

    out = {}
    rank = tp_mesh.get_local_rank()
    tokens = torch.stack([r["input_ids"] for r in make_rows(1)])
    for arch in ARCHS:
        aux = arch != "deepseek_v3"
        reference, split = moe_model(arch, aux), moe_model(arch, aux)
        apply_tensor_parallel(split, tp_mesh)
        ref_loss = reference(input_ids=tokens, labels=tokens).loss
        ref_loss.backward()
        loss = split(input_ids=tokens, labels=tokens).loss
        loss.backward()
        worst, worst_name = 0.0, ""
        for (name, param), ref in zip(split.named_parameters(), reference.parameters(), strict=True):
            grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
            diff = float((grad - ref.grad).abs().max() / ref.grad.abs().max().clamp_min(1e-12))
            worst, worst_name = max((worst, worst_name), (diff, name))
        norm = float(global_grad_norm([p.grad for p in split.parameters()]))
        ref_norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()])))
        # the checkpoint: packed expert weights saved as the one-process tensors (as the engine's checkpoint IO does)
        state = {"model": split.state_dict()}
        packed_as_slices(state)
        ckpt = out_dir / f"styles_{arch}"
        dcp.save(state, checkpoint_id=str(ckpt))
        dist.barrier()
        if rank == 0:
            dcp_to_torch_save(str(ckpt), str(ckpt) + ".pt")
        dist.barrier()
        saved = torch.load(str(ckpt) + ".pt", weights_only=True)["model"]
        expected = reference.state_dict()
        saved_equal = sorted(saved) == sorted(expected) and all(torch.equal(saved[n], t) for n, t in expected.items())
        layer = 1 if arch == "deepseek_v3" else 0  # (DeepSeek-V3's first layer is dense)
        experts = split.get_submodule(f"model.layers.{layer}.mlp.experts")
        full = reference.get_submodule(f"model.layers.{layer}.mlp.experts")
        inter = full.down_proj.shape[2]
        half = inter // 2
        mine = slice(rank * half, (rank + 1) * half)  # this rank's slice of the intermediate features
        gate_up = torch.cat([full.gate_up_proj[:, mine], full.gate_up_proj[:, inter:][:, mine]], dim=1)
        out[arch] = {
            "loss_rel": abs(float(loss) - float(ref_loss)) / float(ref_loss), "grad_rel": worst, "worst": worst_name,
            "all_dtensors": all(isinstance(p, DTensor) for p in split.parameters()),
            "gate_up_slices": torch.equal(experts.gate_up_proj.to_local(), gate_up.detach()),
            "down_slices": torch.equal(experts.down_proj.to_local(), full.down_proj[:, :, mine].detach()),
            "aux": aux and float(reference(input_ids=tokens, labels=tokens).aux_loss) > 0,
            "norm_rel": abs(norm - ref_norm) / ref_norm, "checkpoint_equal": saved_equal,
        }
    out["user_experts"] = user_experts(tp_mesh)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", nargs="*", default=[])
    parser.add_argument("--errors", nargs="*", default=[])
    parser.add_argument("--styles", action="store_true", help="also apply the plans without Lightning (styles())")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results: dict[str, Any] = {}
    root = Path(args.out).parent
    rows = make_rows(STEPS)
    if args.styles:
        from torch.distributed.device_mesh import init_device_mesh

        # (each part of the launch on its own: an error fails the tests reading that part only)
        applied, error = case_or_error(partial(styles, init_device_mesh("cpu", (world,)), root))
        gathered: list[dict | None] = [None] * world
        dist.all_gather_object(gathered, applied)
        results["styles"] = {"error": error} if error else gathered
    for name in args.cases:
        case = CASES[name]
        assert case.world == world, f"{name} runs on {case.world} ranks, this launch has {world}"
        start = time.perf_counter()
        trained, error = case_or_error(partial(_train, case, rows, root / name))
        if error:
            results[name] = {"error": error}
            print(f"{name}: {error[:300]}", flush=True)
            continue
        losses, placements_of = trained
        seconds = time.perf_counter() - start
        placements: list[dict | None] = [None] * world
        dist.all_gather_object(placements, placements_of)
        if rank == 0:
            batches = batches_of(rows[:RESUME_EPOCH * BATCH]) * 2 if case.resume else batches_of(rows)
            dp = world // case.layout.get("tp", 1) // case.layout.get("pp", 1) // case.layout.get("cp", 1)
            cp = case.layout.get("cp", 1)
            # the global scope: one process on whole batches (the tokens cp holds); the per-rank loss's reference is
            # another function
            ref = reference(case, batches, chunks=1 if case.scope == "global" else dp if "ep" in case.layout else 1,
                            cp=cp)
            results[name] = {"fit": losses, "reference": ref["losses"], "aux_terms": ref["aux_terms"],
                             "placements": placements, "seconds": seconds}
            if case.scope == "global":
                results[name]["other_scope"] = reference(replace(case, scope=None), batches, chunks=dp, cp=cp)["losses"]
            elif "ep" in case.layout and case.aux:  # what one process computes on whole batches: another function
                results[name]["other_scope"] = reference(case, batches)["losses"]
            print(f"{name}: {seconds:.1f} s, losses {losses[:3]} vs {ref['losses'][:3]}", flush=True)
    for name in args.errors:
        case, layout, _ = ERROR_CASES[name]
        errors = every_ranks_error(partial(fit, case, rows[:BATCH], root / name, layout, heartbeat=False))
        if rank == 0:
            results[name] = {"errors": errors}
            print(f"{name}: {errors[0][:200]}", flush=True)
    if rank == 0:
        Path(args.out).write_text(json.dumps(results, indent=1))
    close_process_group()


if __name__ == "__main__":
    main()
