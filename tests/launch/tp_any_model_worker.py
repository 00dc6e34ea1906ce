"""Tensor parallelism on 2 gloo ranks without Lightning, for tests/launch/test_tp_any_model.py.

    python -m torch.distributed.run --standalone --nproc_per_node=2 -m tests.launch.tp_any_model_worker OUT_DIR

Each rank writes ``OUT_DIR/rank{N}.json`` with what it measured:

* ``gradients``: the GPT-2-style model (non-zero biases, tied and untied, with and without sequence parallelism)
  split over the 2 ranks against the same model in one piece in the same process: loss and every gradient;
* ``rng``: a dropout MLP whose middle dropout is inside the tensor-parallel region: which masks agree over the
  ranks, with the RNG tracker (the ranks seeded differently on purpose) and without it (seeded the same);
* ``gpt2_dropout``: the GPT-2-style model with dropout: embedding-dropout masks and residual stream across ranks;
* ``block_traffic``: the collectives of one GPT-2 block's forward and backward (kind, elements);
* ``bad_plans``: rank 0 applies bad plans while rank 1 issues no collective at all, so a plan that got as far as
  a collective would block rank 0 (until the process-group timeout) instead of raising at once;
* ``fused``: a nanoGPT-style model with one fused q|k|v ``nn.Linear`` (:class:`FusedLM`): plain-SGD steps under
  ``packed_colwise:3`` against one process, its deferred materialisation and a DCP save read back as the
  one-process tensors and into another tp2 model; ``colwise`` and a global-head-count attention refused by the
  setup self-check, whose cost is timed.
"""

from __future__ import annotations

import functools
import json
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from lightning_par.examples.gpt import causal_lm_loss
from lightning_par.examples.gpt2 import GPT2, GPT2Config
from lightning_par.parallel.tensor_parallel import apply_tensor_parallel
from lightning_par.topology import LayoutError
from tests.harness import close_process_group


class DropoutMLP(nn.Module):
    """x -> dropout -> up (column-parallel) -> gelu -> dropout -> down (row-parallel) -> dropout."""

    tp_plan = {"up": "colwise", "down": "rowwise"}

    def __init__(self, dim: int = 32, hidden: int = 128, p: float = 0.5):
        super().__init__()
        self.drop_in = nn.Dropout(p)  # replicated input: masks must agree over tp
        self.up = nn.Linear(dim, hidden)
        self.drop_mid = nn.Dropout(p)  # inside the region, each rank's own features: masks must differ
        self.down = nn.Linear(hidden, dim)
        self.drop_out = nn.Dropout(p)  # after the row-parallel all-reduce, replicated: masks must agree

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop_out(self.down(self.drop_mid(F.gelu(self.up(self.drop_in(x))))))


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _record_masks(model: nn.Module, names: list[str]) -> dict[str, list[torch.Tensor]]:
    masks: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    for name in names:
        def hook(_m, inputs, output, name=name):
            masks[name].append(((output == 0) & (inputs[0] != 0)).flatten())
        model.get_submodule(name).register_forward_hook(hook)
    return masks


def _agreement(local: list[torch.Tensor]) -> dict:
    """Over the ranks: are the masks equal, and which fraction of the elements differs (rank 0 vs rank 1)."""
    mask = torch.cat(local)
    masks = _gather(mask)
    return {"equal": all(torch.equal(masks[0], m) for m in masks[1:]),
            "differing_fraction": float((masks[0] != masks[1]).float().mean()),
            "dropped_fraction": float(mask.float().mean())}


def rng_masks(mesh: DeviceMesh, tracker: bool) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DropoutMLP()
    x = torch.randn(4, 16, 32)
    # with the tracker the ranks are seeded differently on purpose: it makes the default generator agree over tp
    torch.manual_seed(100 + rank if tracker else 100)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = apply_tensor_parallel(model, mesh, rng=tracker)
    names = ["drop_in", "drop_mid", "drop_out"]
    masks = _record_masks(model, names)
    outputs = [model(x) for _ in range(3)]
    result = {name: _agreement(masks[name]) for name in names}
    result["outputs_equal"] = all(torch.equal(a, b) for a, b in zip(*_gather(outputs), strict=True))
    result["default_generator_equal"] = len({bytes(s.numpy()) for s in _gather(torch.get_rng_state())}) == 1
    result["sync_warning"] = any("differed from tp rank 0" in str(w.message) for w in caught)
    if plan.rng is not None:
        result["common_seed"] = plan.rng.seed
        state = torch.get_rng_state()
        with plan.rng.region():
            inside = torch.rand(8)
        result["region_left_default_unadvanced"] = torch.equal(state, torch.get_rng_state())
        with plan.rng.region():
            again = torch.rand(8)  # the same region, step and default state: the same draw (what recompute needs)
        result["region_replayed"] = torch.equal(inside, again)
        outside = torch.rand(8)
        result["region_rand_equal"] = torch.equal(*_gather(inside))
        result["outside_rand_equal"] = torch.equal(*_gather(outside))
    return result


class DropoutStack(nn.Module):
    """Residual blocks of :class:`DropoutMLP`."""

    tp_plan = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}

    def __init__(self, n: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList([DropoutMLP(p=0.3) for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def recompute(mesh: DeviceMesh) -> dict:
    """Each block's forward recomputed in backward (torch.utils.checkpoint, as lightning_par.parallel.recompute's
    "full" does): the recomputed masks, inside the regions too, must be the ones of the forward."""
    from torch.utils.checkpoint import checkpoint

    results = []
    for recomputed in (False, True):
        torch.manual_seed(0)
        model = DropoutStack()
        apply_tensor_parallel(model, mesh)
        if recomputed:
            for block in model.blocks:
                block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
        x = torch.randn(4, 16, 32, requires_grad=True)
        for _ in range(2):  # the second step draws other masks than the first
            model(x).square().sum().backward()
        grads = {n: _full(p.grad) for n, p in model.named_parameters()}
        results.append((x.grad, grads))
    (x_plain, plain), (x_recomputed, recomputed_grads) = results
    return {"input_grad_equal": torch.equal(x_plain, x_recomputed),
            "max_grad_diff": max(float((plain[n] - recomputed_grads[n]).abs().max()) for n in plain)}


def gpt2_dropout(mesh: DeviceMesh, sequence_parallel: bool) -> dict:
    torch.manual_seed(0)
    model = GPT2(GPT2Config(n_layer=2, dropout=0.2))
    plan = apply_tensor_parallel(model, mesh, sequence_parallel=sequence_parallel)
    masks = _record_masks(model, ["drop"])
    residual = []
    model.ln_f.register_forward_hook(lambda _m, inputs, _out: residual.append(inputs[0].detach()))
    tokens = torch.randint(0, 256, (2, 33))
    with plan.loss_context():
        loss = causal_lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
    return {"embedding_dropout": _agreement(masks["drop"]),
            "residual_equal": torch.equal(*_gather(residual[0])),
            "loss": float(loss.detach())}


def _gpt2_with_biases(config: GPT2Config) -> GPT2:
    torch.manual_seed(0)
    model = GPT2(config)
    with torch.no_grad():  # GPT-2 starts its biases at zero; make them count, so a bias added twice would show
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(std=0.1)
    return model


def gradients(mesh: DeviceMesh, tied: bool, sequence_parallel: bool) -> dict:
    config = GPT2Config(n_layer=2, tie_word_embeddings=tied)
    reference, model = _gpt2_with_biases(config), _gpt2_with_biases(config)
    plan = apply_tensor_parallel(model, mesh, sequence_parallel=sequence_parallel)
    torch.manual_seed(1)
    tokens = torch.randint(0, 256, (4, 33))
    ref_loss = causal_lm_loss(reference(tokens[:, :-1]), tokens[:, 1:])
    ref_loss.backward()
    with plan.loss_context():
        loss = causal_lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    # relative to the largest gradient entry of the model: attention's k_proj bias has a gradient of exactly zero in
    # exact arithmetic (softmax ignores a constant added to a row's scores), so its own scale is rounding noise
    scale = max(g.abs().max() for g in ref_grads.values())
    worst, worst_name = 0.0, ""
    for name, param in model.named_parameters():
        grad = _full(param.grad)
        diff = float((grad - ref_grads[name]).abs().max() / scale)
        if diff >= worst:
            worst, worst_name = diff, name
    split = [n for n, p in model.named_parameters() if isinstance(p, DTensor) and p.placements[0].is_shard()]
    loss, ref_loss = float(loss.detach()), float(ref_loss.detach())
    return {"loss_rel": abs(loss - ref_loss) / ref_loss, "grad_rel": worst, "worst": worst_name,
            "n_params": len(ref_grads), "n_split": len(split), "tied": model.lm_head.weight is model.wte.weight}


def block_traffic(mesh: DeviceMesh, sequence_parallel: bool) -> dict:
    """One block: q/k/v share one input collective (attention is a region), c_fc has its own (a direct child of the
    block, next to its norms)."""
    from lightning_par.parallel.tp_accounting import layer_traffic

    torch.manual_seed(0)
    model = GPT2(GPT2Config(n_layer=1))
    apply_tensor_parallel(model, mesh, sequence_parallel=sequence_parallel)
    x = torch.randn(2, 16, model.config.n_embd)
    if sequence_parallel:
        x = x.chunk(mesh.size(), dim=1)[mesh.get_local_rank()].contiguous()
    summary = layer_traffic(model.h[0], x.requires_grad_(True)).summary()
    return {phase: [(kind, nbytes // 4) for kind, nbytes in summary[f"{phase}_ops"]]  # fp32: elements
            for phase in ("forward", "backward")}


class ConvBlock(nn.Module):
    tp_plan = {"conv": "colwise", "proj": "rowwise"}

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(8, 8, 3)
        self.proj = nn.Linear(8, 8)


class OddLinear(nn.Module):
    tp_plan = {"fc": "colwise"}

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 7)


def _bad_models() -> dict[str, nn.Module]:
    tied_apart = GPT2(GPT2Config(n_layer=1))
    tied_apart.tp_plan = {**GPT2.tp_plan, "wte": "replicate"}
    return {"conv": ConvBlock(), "odd_linear": OddLinear(), "tied_apart": tied_apart,
            "heads": GPT2(GPT2Config(n_layer=1, n_embd=96, n_head=3))}


def bad_plans(mesh: DeviceMesh) -> dict:
    store = dist.distributed_c10d._get_default_store()
    out = {}
    if dist.get_rank() == 0:
        for name, model in _bad_models().items():
            start = time.perf_counter()
            try:
                apply_tensor_parallel(model, mesh)
                out[name] = {"error": None}
            except LayoutError as error:
                out[name] = {"error": str(error), "seconds": time.perf_counter() - start}
        store.set("bad_plans_done", "1")
    else:
        store.wait(["bad_plans_done"])  # no collective until rank 0 is through
    dist.barrier()
    return out


class FusedAttention(nn.Module):
    """Causal attention with q, k and v in one projection, written as nanoGPT does; ``global_heads``: reshape with
    the global head count (wrong under tensor parallelism): ``"view"`` as ``view(b, t, n_heads, head_dim)`` (fails),
    ``"size"`` as ``view(b, t, n_heads, -1)`` (runs, with half the head size)."""

    def __init__(self, dim: int, n_heads: int, global_heads: str = ""):
        super().__init__()
        self.n_heads, self.head_dim, self.global_heads = n_heads, dim // n_heads, global_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        shape = {"": (-1, self.head_dim), "view": (self.n_heads, self.head_dim), "size": (self.n_heads, -1)}
        q, k, v = (y.view(b, t, *shape[self.global_heads]).transpose(1, 2) for y in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class FusedBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, global_heads: str = ""):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = FusedAttention(dim, n_heads, global_heads)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class FusedLM(nn.Module):
    """A user's model as the README says to write one, with a fused q|k|v projection and a plan for it."""

    tp_plan = {"blocks.*.attn.qkv": "packed_colwise:3", "blocks.*.attn.proj": "rowwise",
               "blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise",
               "embed": "vocab_parallel", "head": "vocab_parallel"}

    def __init__(self, vocab: int = 128, dim: int = 64, n_heads: int = 4, n_layers: int = 2,
                 global_heads: str = ""):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([FusedBlock(dim, n_heads, global_heads) for _ in range(n_layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class FusedLMModule(L.LightningModule):
    """:class:`FusedLM` as a user's LightningModule (the README's recipe), for ``lightning-par fit``: ``qkv_style``
    replaces the q|k|v plan entry, ``global_heads`` makes attention reshape with the global head count."""

    def __init__(self, qkv_style: str = "packed_colwise:3", global_heads: str = ""):
        super().__init__()
        self.save_hyperparameters()
        self.model: FusedLM | None = None

    def configure_model(self):
        if self.model is None:
            self.model = FusedLM(vocab=256, global_heads=self.hparams.global_heads)
            self.model.tp_plan = {**FusedLM.tp_plan, "blocks.*.attn.qkv": self.hparams.qkv_style}

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        return causal_lm_loss(self.model(inputs), targets)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fused_model(seed: int = 0, **kwargs) -> FusedLM:
    torch.manual_seed(seed)
    model = FusedLM(**kwargs)
    with torch.no_grad():  # biases that count: a q|k|v bias split like plain colwise would show
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(std=0.1)
    return model


def _refusal(mesh: DeviceMesh, model: nn.Module) -> dict:
    from lightning_par.parallel import tensor_parallel

    tensor_parallel._SELF_CHECKED.clear()
    start = time.perf_counter()
    try:
        apply_tensor_parallel(model, mesh)
        return {"error": None}
    except LayoutError as error:
        return {"error": str(error), "seconds": time.perf_counter() - start}


def fused(mesh: DeviceMesh, out_dir: Path) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from lightning_par.parallel import tensor_parallel
    from lightning_par.parallel.deferred_init import deferred_init
    from lightning_par.parallel.materialize import materialize_share
    from lightning_par.parallel.tensor_parallel import packed_as_slices, restore_packed

    result: dict = {}
    # (1) plain SGD, 5 steps: the split model against the same model in one piece
    reference, model = _fused_model(), _fused_model()
    tensor_parallel._SELF_CHECKED.clear()
    start = time.perf_counter()
    plan = apply_tensor_parallel(model, mesh)
    result["apply_seconds"] = time.perf_counter() - start
    result["qkv_placement"] = str(model.blocks[0].attn.qkv.weight.placements)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    torch.manual_seed(1)
    losses, ref_losses = [], []
    for _ in range(5):
        tokens = torch.randint(0, 128, (4, 17))
        ref_loss = causal_lm_loss(reference(tokens[:, :-1]), tokens[:, 1:])
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        with plan.loss_context():
            loss = causal_lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(_full(loss).detach()))
        ref_losses.append(float(ref_loss.detach()))
    result["losses"], result["ref_losses"] = losses, ref_losses
    result["weights_rel"] = max(float((_full(p) - r).detach().abs().max() / r.abs().max()) for p, r in
                                zip(model.parameters(), reference.parameters(), strict=True))
    # (1b) with sequence parallelism: one step's loss and every gradient against one process
    reference, split = _fused_model(), _fused_model()
    sp_plan = apply_tensor_parallel(split, mesh, sequence_parallel=True)
    tokens = torch.randint(0, 128, (4, 17))
    ref_loss = causal_lm_loss(reference(tokens[:, :-1]), tokens[:, 1:])
    ref_loss.backward()
    with sp_plan.loss_context():
        loss = causal_lm_loss(split(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
    scale = max(float(p.grad.abs().max()) for p in reference.parameters())
    result["sp_loss_rel"] = abs(float(_full(loss).detach()) - float(ref_loss)) / float(ref_loss)
    from lightning_par.parallel.grad_norm import global_grad_norm

    norm = float(global_grad_norm([p.grad for p in split.parameters()]))  # what clipping uses
    ref_norm = float(torch.linalg.vector_norm(torch.stack([r.grad.norm() for r in reference.parameters()])))
    result["grad_norm_rel"] = abs(norm - ref_norm) / ref_norm
    result["sp_grad_rel"] = max(float((_full(p.grad) - r.grad).abs().max()) / scale for p, r in
                                zip(split.parameters(), reference.parameters(), strict=True))
    # (2) a DCP save: the packed tensors go to disk as the one-process tensors, and load back into another model
    ckpt = out_dir / "fused_dcp"
    state = {"model": model.state_dict()}
    packed_as_slices(state)
    dcp.save(state, checkpoint_id=str(ckpt))
    dist.barrier()
    if dist.get_rank() == 0:
        dcp_to_torch_save(str(ckpt), str(out_dir / "fused.pt"))
    dist.barrier()
    saved = torch.load(out_dir / "fused.pt", weights_only=True)["model"]
    result["saved_equal_one_process"] = all(torch.equal(saved[n], _full(t).detach())
                                            for n, t in model.state_dict().items())
    result["saved_names"] = sorted(saved) == sorted(reference.state_dict())
    other = _fused_model(seed=5)
    apply_tensor_parallel(other, mesh)
    target = {"model": other.state_dict()}
    replaced = packed_as_slices(target)
    dcp.load(target, checkpoint_id=str(ckpt))
    restore_packed(replaced)
    result["reloaded_equal"] = all(torch.equal(p.to_local(), q.to_local()) for p, q in
                                   zip(other.parameters(), model.parameters(), strict=True))
    # (3) built deferred (on meta), split, materialised: each rank's share is the one-process values
    with deferred_init(threshold=0) as record:
        torch.manual_seed(0)
        deferred = FusedLM()
    record.capture(deferred)
    apply_tensor_parallel(deferred, mesh)
    materialize_share(deferred, record, torch.device("cpu"))
    torch.manual_seed(0)
    eager = FusedLM()
    result["materialized_equal"] = all(torch.equal(_full(p), q) for p, q in
                                       zip(deferred.parameters(), eager.parameters(), strict=True))
    # (3b) pretrained weights (a .safetensors file of one process) read into the packed shards, part by part
    from safetensors.torch import save_file

    from lightning_par.plugins.pretrained import load_pretrained

    source = _fused_model(seed=7)
    if dist.get_rank() == 0:
        save_file({n: t.contiguous() for n, t in source.state_dict().items()}, str(out_dir / "fused.safetensors"))
    dist.barrier()
    loaded = _fused_model(seed=5)
    apply_tensor_parallel(loaded, mesh)
    load_pretrained(loaded, out_dir / "fused.safetensors", prefix="")
    result["pretrained_equal"] = all(torch.equal(_full(p), q) for p, q in
                                     zip(loaded.parameters(), source.parameters(), strict=True))
    # (4) refusals by the setup self-check, and its cost on a passing model of ~100M parameters
    colwise = _fused_model()
    colwise.tp_plan = {**FusedLM.tp_plan, "blocks.*.attn.qkv": "colwise"}
    result["colwise"] = _refusal(mesh, colwise)
    result["global_heads"] = _refusal(mesh, _fused_model(global_heads="view"))
    result["global_heads_view"] = _refusal(mesh, _fused_model(global_heads="size"))
    with deferred_init(threshold=0):
        big = FusedLM(vocab=32768, dim=768, n_heads=12, n_layers=12)
    tensor_parallel._SELF_CHECKED.clear()
    from lightning_par.parallel.tensor_parallel import resolve_tp_plan, self_check
    big_plan = resolve_tp_plan(big, 2)
    result["big_params"] = sum(p.numel() for p in big.parameters())
    result["self_check_seconds_big"] = self_check(big, big_plan, mesh, "FusedLM", FusedLM.tp_plan)
    result["self_check_seconds_big_again"] = self_check(big, big_plan, mesh, "FusedLM", FusedLM.tp_plan)
    tensor_parallel._SELF_CHECKED.clear()
    result["self_check_seconds_tiny"] = self_check(_fused_model(), resolve_tp_plan(_fused_model(), 2), mesh,
                                                   "FusedLM", FusedLM.tp_plan)
    return result


def main(out_dir: str) -> None:
    # a collective that rank 1 never joins fails after this long instead of hanging the test
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    result = {
        "gradients": {f"tied={tied},sp={sp}": gradients(mesh, tied, sp) for tied in (False, True)
                      for sp in (False, True)},
        "rng": {"tracker": rng_masks(mesh, tracker=True), "no_tracker": rng_masks(mesh, tracker=False)},
        "gpt2_dropout": {f"sp={sp}": gpt2_dropout(mesh, sp) for sp in (False, True)},
        "block_traffic": {f"sp={sp}": block_traffic(mesh, sp) for sp in (False, True)},
        "recompute": recompute(mesh),
        "bad_plans": bad_plans(mesh),
    }
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    result["fused"] = fused(mesh, Path(out_dir))
    (Path(out_dir) / f"rank{dist.get_rank()}.json").write_text(json.dumps(result, indent=1))
    close_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
