"""Lightning's own strategy contract, on CPU/gloo, under lightning-par layouts: many checks per layout, one launch.

Ported from Lightning's GPU-only tests (tests/tests_pytorch: strategies/test_model_parallel_integration.py,
strategies/test_fsdp.py, strategies/test_ddp_integration.py, trainer/test_trainer.py,
trainer/logging_/test_train_loop_logging.py): their intent and assertions, written anew. Adaptations, everywhere:

* CPU and gloo instead of CUDA and NCCL; the ranks are torchrun's (``tests.harness.launch_matrix``), not Lightning's
  subprocess launcher re-running pytest; one process group serves every Trainer of the launch.
* the model is the tiny example GPT (``GPTLightningModule``: it declares the tp and pp plans every layout needs)
  instead of Lightning's ``BoringModel`` / ``TemplateModel`` / ``FSDP2Model``; batches are fixed random tokens.
* plain SGD (no momentum): numbers are compared with a one-process reference computed on rank 0 by hand (the same
  initial weights, the same global batches), to 1e-5, where Lightning's tests only check that a stage runs.
* context parallel layouts (not in Lightning) are run too; their predict is refused by design (generation needs whole
  sequences on a rank), which the test asserts instead of predictions.
* ``lightning_module_state_dict()`` is compared with the sharded form of Lightning's ``ModelParallelStrategy``
  (``save_distributed_checkpoint=True``: every rank, the unsplit model's keys in order); its values are gathered
  here to compare them with the reference.

Every rank writes ``ROOT/LAYOUT/rank{R}.json`` with what it measured; tests/launch/test_lightning_contract.py asserts.
"""

from __future__ import annotations

import argparse
import json
import shutil
import traceback
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_par import LayoutStrategy
from lightning_par.examples import GPTLightningModule
from lightning_par.parallel.zero_state import pieces
from lightning_par.plugins.checkpoint_export import export_lightning
from lightning_par.topology import LayoutError

SEED = 1234
LR = 0.2
GLOBAL_BATCH = 8
SEQ = 32
N_LAYERS = 4
FIT_STEPS = 2
EVAL_BATCHES = 2

#: name -> (strategy arguments, ranks); the per-rank batch is GLOBAL_BATCH / dp
LAYOUTS: dict[str, dict] = {
    "zero0": dict(zero_stage=0),
    "zero1": dict(zero_stage=1),
    "zero2": dict(zero_stage=2),
    "zero3": dict(zero_stage=3),
    "tp2": dict(tp=2),
    "pp2": dict(pp=2, schedule="1f1b", n_microbatches=2),
    "tp2_pp2": dict(tp=2, pp=2, schedule="1f1b", n_microbatches=2),
    # context parallel (predict is refused there: generation needs whole sequences)
    "cp2": dict(cp=2),
    "cp2_pp2": dict(cp=2, pp=2, schedule="1f1b", n_microbatches=2),
}


def tokens(n: int, seed: int) -> TensorDataset:
    data = torch.randint(0, 256, (n, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return TensorDataset(data[:, :-1].contiguous(), data[:, 1:].contiguous())


def loader(dataset: TensorDataset, batch: int) -> DataLoader:
    return DataLoader(dataset, batch_size=batch, shuffle=False)


class SeededGPT(GPTLightningModule):
    """The tiny GPT, drawn from ``SEED`` whenever it is built; its training losses kept by step."""

    def __init__(self, build_now: bool = False):
        super().__init__(preset="tiny", n_layers=N_LAYERS, optimizer="sgd", lr=LR)
        self.train_losses: list[float] = []
        self.modes: dict[str, bool] = {}  # whether the module was in training mode in each stage's steps
        if build_now:  # built in __init__, as a model under Trainer.init_module is
            self.configure_model()

    def configure_model(self):
        if self.model is None:
            torch.manual_seed(SEED)
            super().configure_model()

    def on_train_start(self):
        self.initial_sums = {n: float(full(p).detach().double().sum()) for n, p in self.named_parameters()}
        self.modes: dict[str, bool] = {}

    def training_step(self, batch, batch_idx):
        # test_train_loop_logging.py::test_logging_sync_dist_true_ddp / ::test_metric_are_properly_reduced: a value
        # per data-parallel replica (its dp coordinate + 1), reduced over the replicas, each counted once
        strategy = self.trainer.strategy
        dp_rank = strategy.coordinates["dp"] if isinstance(strategy, LayoutStrategy) else strategy.global_rank
        value = torch.tensor(float(dp_rank + 1))
        for fx in ("sum", "mean", "max"):
            self.log(f"probe/{fx}", value, sync_dist=True, reduce_fx=fx, on_step=True, on_epoch=False, batch_size=1)
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.modes["train"] = self.training
        # the replica's loss averaged over data parallel: the whole global batch's, as one process computes it
        self.train_losses.append(float(self.trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")))

    def validation_step(self, batch, batch_idx):
        self.modes["validate"] = self.training
        return super().validation_step(batch, batch_idx)

    def test_step(self, batch, batch_idx):
        self.modes["test"] = self.training
        return super().test_step(batch, batch_idx)

    def predict_step(self, batch, batch_idx):
        self.modes["predict"] = self.training
        return super().predict_step(batch, batch_idx)


def new_model(build_now: bool = False) -> SeededGPT:
    return SeededGPT(build_now)


def full(value):
    return value.full_tensor() if isinstance(value, DTensor) else value


def reference() -> dict:
    """One process, by hand: the same initial weights, plain SGD on the global batches (two steps, the weights and
    eval loss then; a third, the eval loss after it)."""
    torch.manual_seed(SEED)
    lm = new_model()
    lm.configure_model()
    opt = torch.optim.SGD(lm.parameters(), lr=LR)
    initial = {n: float(p.detach().double().sum()) for n, p in lm.named_parameters()}
    # a sequential loader stays sequential under a distributed sampler (Lightning's rule): the global batches in order
    data = tokens(GLOBAL_BATCH * FIT_STEPS, 1)
    losses = []
    for batch in loader(data, GLOBAL_BATCH):
        loss = lm.compute_loss(batch)
        losses.append(float(loss))
        opt.zero_grad()
        loss.backward()
        opt.step()
    trained = sums(lm.state_dict())
    # a later fit's third step: epoch 1's first global batch
    batch = next(iter(loader(data, GLOBAL_BATCH)))
    with torch.no_grad():
        val = [float(lm.compute_loss(b)) for b in loader(tokens(GLOBAL_BATCH * EVAL_BATCHES, 2), GLOBAL_BATCH)]
    loss = lm.compute_loss(batch)
    losses.append(float(loss))
    opt.zero_grad()
    loss.backward()
    opt.step()
    with torch.no_grad():  # after the third step
        val3 = [float(lm.compute_loss(b)) for b in loader(tokens(GLOBAL_BATCH * EVAL_BATCHES, 2), GLOBAL_BATCH)]
    return {"train": losses, "eval_after_3": sum(val3) / len(val3), "initial_sums": initial,
            "eval": sum(val) / len(val), "keys": list(lm.state_dict().keys()),
            "sums": trained}


def trainer(root: Path, strategy_args: dict, **kwargs) -> pl.Trainer:
    args = dict(accelerator="cpu", devices=dist.get_world_size(), strategy=LayoutStrategy(**strategy_args),
                max_steps=FIT_STEPS, limit_val_batches=EVAL_BATCHES, num_sanity_val_steps=0, logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                default_root_dir=root)
    args.update(kwargs)
    return pl.Trainer(**args)


def optimizer_saved(path: Path) -> bool:
    """Whether the checkpoint at ``path`` (one file or a DCP directory) holds optimizer states."""
    if path.is_dir():
        return any(k.startswith("optimizer_") for k in FileSystemReader(path).read_metadata().state_dict_metadata)
    return bool(torch.load(path, weights_only=True).get("optimizer_states"))


def sums(state: dict) -> dict:
    """Per entry: (sum, sum of magnitudes) of the whole value; None for an entry held by another stage (meta)."""
    out = {}
    for key, value in state.items():
        value = full(value)
        out[key] = None if value.is_meta else [float(value.double().sum()), float(value.double().abs().sum())]
    return out


class MomentumGPT(SeededGPT):
    """SGD with momentum: an optimizer state (per-parameter buffers) for the plain-checkpoint check."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


def run(root: Path, name: str) -> None:
    strategy_args = LAYOUTS[name]
    out = root / name
    out.mkdir(parents=True, exist_ok=True)
    rank = dist.get_rank()
    report: dict = {"errors": {}}
    dp = LayoutStrategy(**strategy_args).layout.resolve(dist.get_world_size()).dp
    batch = GLOBAL_BATCH // dp
    train, evaluate = tokens(GLOBAL_BATCH * FIT_STEPS, 1), tokens(GLOBAL_BATCH * EVAL_BATCHES, 2)

    def check(label, fn):
        try:
            fn()
        except (Exception, CheckpointException) as error:  # every check runs; the report names what failed
            # (DCP's CheckpointException is a BaseException)
            report["errors"][label] = f"{type(error).__name__}: {error}"[-2000:]
            traceback.print_exc()

    # -- test_ddp_integration.py::test_multi_gpu_model_ddp_fit_test, test_trainer.py::test_fit_test_synchronization
    # and ::test_model_in_correct_mode_during_stages: fit, then validate / test / predict on the same Trainer and
    # model, the losses the one-process run's; test_trainer.py::test_model_checkpoint_only_weights and
    # test_model_parallel_integration.py::test_save_load_sharded_state_dict: a save after every stage
    torch.manual_seed(SEED)
    model = new_model()
    # test_fsdp.py::test_checkpoint_multi_gpus: ModelCheckpoint(save_last=True) saves while fitting
    t = trainer(out, strategy_args, enable_checkpointing=True,
                callbacks=[ModelCheckpoint(dirpath=out / "checkpoints", save_last=True)])

    def fit():
        t.fit(model, loader(train, batch))
        report["fit_losses"] = list(model.train_losses)
        # test_model_parallel_integration.py::test_tensor_parallel: the optimizer's parameters are the layout's
        # DTensors, tensor-parallel ones on device_mesh["tp"]
        params = [p for g in t.strategy.optimizers[0].param_groups for p in g["params"]]
        report["optimizer_meshes"] = sorted({"x".join(p.device_mesh.mesh_dim_names) for p in params
                                             if isinstance(p, DTensor)})
        report["optimizer_on_tp_mesh"] = all(p.device_mesh == t.strategy.device_mesh["tp"] for p in params
                                             if isinstance(p, DTensor))
        report["initial_sums"] = model.initial_sums
        report["logged"] = {fx: float(t.callback_metrics[f"probe/{fx}"]) for fx in ("sum", "mean", "max")}
        report["dp"] = t.strategy.dims.dp
    check("fit", fit)
    check("save_after_fit", lambda: t.save_checkpoint(out / "after_fit.ckpt"))

    def evaluate_stage(stage):
        def go():
            results = getattr(t, stage)(model, loader(evaluate, batch))
            report[f"{stage}_loss"] = float(results[0][f"{'val' if stage == 'validate' else stage}/loss"])
        return go
    check("validate", evaluate_stage("validate"))
    check("save_after_validate", lambda: t.save_checkpoint(out / "after_validate.ckpt"))
    check("test", evaluate_stage("test"))
    check("save_after_test", lambda: t.save_checkpoint(out / "after_test.ckpt"))

    # -- test_model_parallel_integration.py::test_strategy_state_dict (save_distributed_checkpoint=True): every
    # rank, the unsplit model's keys in order; the values are the trained model's
    def state_dict():
        state = t.strategy.lightning_module_state_dict()
        report["state_keys"] = list(state.keys())
        report["state_sums"] = sums(state)
    check("state_dict", state_dict)

    def predict():
        predictions = t.predict(model, loader(evaluate, batch))
        report["predictions"] = [list(p.shape) for p in predictions]
    check("predict", predict)
    check("save_after_predict", lambda: t.save_checkpoint(out / "after_predict.ckpt"))
    report["modes"] = model.modes

    # -- test_fsdp.py::_run_multiple_stages (test_checkpoint_multi_gpus, test_strategy_checkpoint): after fit and
    # test, a save, a weights-only save over ModelCheckpoint's last, then under torch.inference_mode() test and
    # predict, of the model and from the weights-only checkpoint (upstream compares the saved weights with the
    # model's where the checkpoint is one file; the test does it for every layout from the files)
    def multiple_stages():
        last = Path(t.strategy.broadcast(t.checkpoint_callback.last_model_path))
        report["ms_last_saved"] = last.exists()
        t.save_checkpoint(last.with_name("after-test.ckpt"))
        t.save_checkpoint(last, weights_only=True)
        report["ms_optimizer_saved"] = [optimizer_saved(last.with_name("after-test.ckpt")), optimizer_saved(last)]
        if rank == 0:  # kept for the test (the next fit's ModelCheckpoint writes `last` again)
            (shutil.copytree if last.is_dir() else shutil.copy2)(last, out / "weights_only.ckpt")
        with torch.inference_mode():
            report["ms_test_model"] = float(t.test(model, loader(evaluate, batch))[0]["test/loss"])
            report["ms_test_ckpt"] = float(t.test(ckpt_path=last, dataloaders=loader(evaluate, batch))[0]["test/loss"])
            if "cp" not in strategy_args:  # (predict is refused under context parallel, see above)
                torch.manual_seed(SEED)  # generation samples: the same draws for both
                of_model = t.predict(model, loader(evaluate, batch))
                torch.manual_seed(SEED)
                of_ckpt = t.predict(ckpt_path=last, dataloaders=loader(evaluate, batch))
                report["ms_predictions"] = [list(p.shape) for p in of_ckpt]
                report["ms_predictions_equal"] = all(torch.equal(a, b) for a, b in zip(of_model, of_ckpt, strict=True))
        # the weights stay trainable (fit_again below trains them): no inference tensors
        report["ms_inference_params"] = sum(p.is_inference() for p in model.parameters())
        # torchmetrics' reset at the end of a stage run in inference mode leaves inference tensors as the metric's
        # states, which a later update outside it cannot change in place (under any strategy, Lightning's own too)
        model.test_ppl.reset()
    check("multiple_stages", multiple_stages)

    # -- test_trainer.py::test_repeated_fit_calls_with_max_epochs_and_steps, with one more step to train: fit again
    # on the same Trainer and model after the evaluations; the step is the one-process run's third
    def fit_again():
        t.fit_loop.epoch_loop.max_steps = FIT_STEPS + 1
        t.fit(model, loader(train, batch))
        report["fit_again_losses"] = list(model.train_losses)
    check("fit_again", fit_again)

    # -- test_trainer.py::test_fit_test_synchronization with a second Trainer: a model another Trainer split or
    # sharded is refused at setup, saying what to do; one it left whole is tested as is
    def other_trainer():
        try:
            report["other_trainer_test_loss"] = float(
                trainer(out / "other", strategy_args).test(model, loader(evaluate, batch))[0]["test/loss"])
        except LayoutError as error:
            report["other_trainer_refused"] = str(error)
    check("other_trainer", other_trainer)

    # -- test_model_parallel_integration.py::test_load_full_state_checkpoint_into_regular_model and
    # test_fsdp.py::test_save_sharded_and_consolidate_and_load: the sharded checkpoint, exported to one file (the
    # documented way), read by LightningModule.load_from_checkpoint and by a stock Lightning strategy (ddp)
    single = out / "exported.ckpt"

    def export_and_load():
        if rank == 0:
            export_lightning(out / "after_test.ckpt", single)
        dist.barrier()
        loaded = SeededGPT.load_from_checkpoint(single)
        report["loaded_sums"] = sums(loaded.state_dict())
        stock = pl.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy="ddp", logger=False,
                           enable_progress_bar=False, enable_model_summary=False)
        report["ddp_test_loss"] = float(stock.test(new_model(), loader(evaluate, GLOBAL_BATCH // dist.get_world_size()),
                                                   ckpt_path=single)[0]["test/loss"])
    check("export_load_from_checkpoint", export_and_load)

    # -- test_model_parallel_integration.py::test_load_full_state_checkpoint_into_regular_model, the other way: the
    # one-file checkpoint (a full state) tested under the layout, with a model built in configure_model
    def one_file_into_layout():
        results = trainer(out / "one_file", strategy_args).test(new_model(), loader(evaluate, batch), ckpt_path=single)
        report["one_file_test_loss"] = float(results[0]["test/loss"])
    check("one_file_into_layout", one_file_into_layout)

    # -- test_model_parallel_integration.py::test_module_init_context, test_fsdp.py::test_module_init_context:
    # Trainer.init_module(empty_init=True) leaves every parameter on the meta device; the strategy materialises
    # them (here with the values one process draws, so the fit is at parity); empty_init=False builds them for real
    # (and a module that builds its network in configure_model: that hook builds it, deferred where the layout splits
    # parameters, as without init_module)
    for empty in (True, False, "configure_model"):
        def init_module(empty=empty):
            t2 = trainer(out / f"init_{empty}", strategy_args)
            with t2.init_module(empty_init=bool(empty)):
                built = new_model(build_now=empty != "configure_model")
            params = dict(built.named_parameters())
            report[f"init_{empty}_meta"] = sorted(n for n, p in params.items() if p.is_meta)
            report[f"init_{empty}_n_params"] = len(params)
            if not empty:  # evaluation first, then fit (the data-parallel owner for training is made then)
                t2.validate(built, loader(evaluate, batch))
            t2.fit(built, loader(train, batch))
            report[f"init_{empty}_losses"] = built.train_losses
            report[f"init_{empty}_initial_sums"] = built.initial_sums
        check(f"init_module_empty_{empty}", init_module)

    # -- test_model_parallel_integration.py::test_load_standard_checkpoint_into_distributed_model: a plain Lightning
    # checkpoint (ddp: optimizer state by position, no parameter names) resumes under the layout, momentum included
    def standard_checkpoint():
        plain = out / "ddp.ckpt"
        torch.manual_seed(SEED)
        ddp = pl.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy="ddp", max_steps=FIT_STEPS,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
        ddp.fit(MomentumGPT(), loader(train, GLOBAL_BATCH // dist.get_world_size()))
        ddp.save_checkpoint(plain)
        dist.barrier()
        saved = torch.load(plain, weights_only=True)
        names = [n for n, _ in MomentumGPT(build_now=True).named_parameters()]
        saved_buffers = {names[i]: s["momentum_buffer"] for i, s in saved["optimizer_states"][0]["state"].items()}
        resumed = MomentumGPT()
        t3 = trainer(out / "resume", strategy_args, max_steps=FIT_STEPS)
        t3.fit(resumed, loader(train, batch), ckpt_path=plain)  # restores, then stops: max_steps reached
        optimizer = t3.strategy.optimizers[0]
        diffs = []
        partitioner = getattr(t3.strategy.gradient_sync, "partitioner", None)
        if partitioner is not None:  # ZeRO-1/2: each rank's chunk of a bucket holds flat ranges of parameters
            name_of = {id(p): n for n, p in resumed.named_parameters()}
            for piece in pieces(partitioner):
                held = optimizer.state[piece.shard]["momentum_buffer"]
                held = held.to_local() if isinstance(held, DTensor) else held
                held = held[piece.at:piece.at + piece.stop - piece.start]
                want = saved_buffers[name_of[id(piece.param)]].reshape(-1)[piece.start:piece.stop]
                diffs.append(float((held - want).abs().max()))
        else:
            for n, p in resumed.named_parameters():  # this rank's (a pipeline stage holds some)
                diffs.append(float((full(optimizer.state[p]["momentum_buffer"]) - saved_buffers[n]).abs().max()))
        report["plain_resume_momentum_max_abs_diff"] = max(diffs)
        report["plain_resume_compared"] = len(diffs)
        # the same file (optimizer states and all) tested under the layout, the model built in __init__ as
        # Lightning's TemplateModel is: only the weights are read
        eager = MomentumGPT(build_now=True)
        results = trainer(out / "plain_test", strategy_args).test(eager, loader(evaluate, batch), ckpt_path=plain)
        report["plain_test_loss"] = float(results[0]["test/loss"])
        per_rank = GLOBAL_BATCH // dist.get_world_size()
        report["plain_ddp_test_loss"] = float(ddp.test(MomentumGPT(), loader(evaluate, per_rank),
                                                       ckpt_path=plain)[0]["test/loss"])
    check("standard_checkpoint", standard_checkpoint)
    (out / f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    args = parser.parse_args()
    root = Path(args.root)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    if dist.get_rank() == 0:
        (root).mkdir(parents=True, exist_ok=True)
        (root / "reference.json").write_text(json.dumps(reference(), indent=1))
    dist.barrier()
    for name in args.layouts:
        run(root, name)


if __name__ == "__main__":
    main()
