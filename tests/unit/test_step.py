"""The step's hooks (lightning_par/strategies/step.py) and the compile report (strategies/compile_report.py), in one
process: the clip's global norm is the step's gradient check (one norm per step, not two) and still catches a
non-finite gradient; a user's own clipping hook keeps the check on this rank's gradients; the compile summary comes
from the callback the strategy adds. The multi-rank parity of the same code is asserted by the launches
(tests/launch/test_engine.py, test_pipeline_strategy.py, test_bad_steps.py, test_compile.py's full matrix)."""

from __future__ import annotations

import pytest
import torch

from lightning_par.run.bad_steps import NonFiniteFlags, NonFiniteStop

STEPS = 4
CLIP = 0.05  # small enough that every step is clipped


def _loader():
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (STEPS * 4, 17), generator=generator)
    return torch.utils.data.DataLoader(list(zip(ids[:, :-1], ids[:, 1:], strict=True)), batch_size=4)


def _model(**kwargs):
    from lightning_par.examples import GPTLightningModule

    torch.manual_seed(0)
    model = GPTLightningModule(preset="tiny", n_layers=2, optimizer="sgd", lr=0.2, **kwargs)
    model.configure_model()  # the weights drawn now, alike for every strategy compared
    return model


class _Losses:
    def __init__(self) -> None:
        import lightning.pytorch as pl

        losses = self.losses = []

        class Record(pl.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                losses.append(float(outputs["loss"]))

        self.callback = Record()


def _fit(model, strategy, callbacks=(), logger=False, clip=CLIP):
    import lightning.pytorch as pl

    losses = _Losses()
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=STEPS, logger=logger,
                         gradient_clip_val=clip, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                         use_distributed_sampler=False,  # the batches in order under every strategy compared
                         callbacks=[losses.callback, *callbacks])
    trainer.fit(model, _loader())
    return trainer, losses.losses


@pytest.fixture
def counted(monkeypatch):
    """Calls per step of: the global norm, the gradient check from this rank's gradients, and from a norm given."""
    import lightning_par.strategies.step as step

    calls = {"global_norm": 0, "local_check": 0, "norm_check": 0}

    def counting(name, function):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(step, "global_grad_norm", counting("global_norm", step.global_grad_norm))
    monkeypatch.setattr(NonFiniteFlags, "add_grads", counting("local_check", NonFiniteFlags.add_grads))
    monkeypatch.setattr(NonFiniteFlags, "add_grad_norm", counting("norm_check", NonFiniteFlags.add_grad_norm))
    return calls


class _OwnClipping:
    """A LightningModule whose own hook clips (here as Lightning would: through the strategy's clip)."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val,
                            gradient_clip_algorithm=gradient_clip_algorithm)


@pytest.mark.parametrize(("case", "expected"), [
    ("clip", {"global_norm": STEPS, "local_check": 0, "norm_check": STEPS}),  # one norm per step
    ("own_clipping_hook", {"global_norm": STEPS, "local_check": STEPS, "norm_check": 0}),
    ("skip_policy", {"global_norm": STEPS, "local_check": STEPS, "norm_check": 0}),  # agreed before the clip
    ("no_clip", {"global_norm": 0, "local_check": STEPS, "norm_check": 0}),
])
def test_the_clips_norm_is_the_steps_gradient_check(one_process_group, counted, case, expected):
    from lightning_par import LayoutStrategy
    from lightning_par.examples import GPTLightningModule

    model = _model() if case != "own_clipping_hook" else type("Mine", (_OwnClipping, GPTLightningModule), {})(
        preset="tiny", n_layers=2, optimizer="sgd", lr=0.2)
    strategy = LayoutStrategy(nonfinite="skip" if case == "skip_policy" else "stop")
    _, losses = _fit(model, strategy, clip=None if case == "no_clip" else CLIP)
    assert counted == expected and len(losses) == STEPS


class _Manual:
    """Manual optimization: the step runs backward and the optimizer itself (``clip``: and clips before the step)."""

    clip = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        loss = self.compute_loss(batch)
        self.manual_backward(loss)
        if self.clip:
            self.clip_gradients(optimizer, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
        optimizer.step()
        optimizer.zero_grad()
        return {"loss": loss.detach()}


def test_manual_optimization_finalizes_in_the_optimizer_step_and_refuses_clip_gradients(one_process_group, counted,
                                                                                        monkeypatch):
    """The gradients are made final inside optimizer.step() (finalize once per step, the check on this rank's
    gradients after it); a clip_gradients before the step would see partial gradients, so it is refused."""
    import lightning_par.strategies.step as step
    from lightning_par import LayoutStrategy
    from lightning_par.examples import GPTLightningModule
    from lightning_par.topology import LayoutError

    finalized: list[int] = []
    real = step.finalize
    monkeypatch.setattr(step, "finalize", lambda owner, runner: (finalized.append(1), real(owner, runner))[1])
    manual = type("Manual", (_Manual, GPTLightningModule), {})
    _, losses = _fit(manual(preset="tiny", n_layers=2, optimizer="sgd", lr=0.2), LayoutStrategy(), clip=None)
    assert len(losses) == STEPS and len(finalized) == STEPS
    assert counted == {"global_norm": 0, "local_check": STEPS, "norm_check": 0}
    clipping = type("ManualClip", (_Manual, GPTLightningModule), {"clip": True})
    with pytest.raises(LayoutError, match="clip_gradients under manual optimization"):
        _fit(clipping(preset="tiny", n_layers=2, optimizer="sgd", lr=0.2), LayoutStrategy(), clip=None)


def test_clipped_steps_match_lightnings_own_strategy(one_process_group):
    from lightning_par import LayoutStrategy

    _, reference = _fit(_model(), "auto")
    _, losses = _fit(_model(), LayoutStrategy())
    _, unclipped = _fit(_model(), "auto", clip=None)
    assert abs(unclipped[1] - reference[1]) > 1e-3  # the clip acted on the first step
    torch.testing.assert_close(losses, reference, rtol=1e-6, atol=0)


def test_a_non_finite_gradient_under_clipping_stops_the_run_naming_the_gradient_norm(one_process_group, capsys):
    from lightning_par import LayoutStrategy

    model = _model()
    weight = next(model.parameters())
    weight.register_hook(lambda grad: torch.full_like(grad, float("nan")) if model.global_step == 1 else grad)
    with pytest.raises(NonFiniteStop) as stop:
        _fit(model, LayoutStrategy())
    assert "step 1 was not finite (the gradient norm)" in stop.value.message, stop.value.message


def test_the_compile_summary_comes_from_the_callback_the_strategy_adds(one_process_group, monkeypatch):
    from lightning.pytorch.loggers import Logger

    import lightning_par.strategies.compile_report as compile_report
    from lightning_par import LayoutStrategy
    from lightning_par.strategies.compile_report import CompileReport

    class Scalars(Logger):
        name, version = "scalars", 0
        metrics: dict = {}

        def log_metrics(self, metrics, step=None):
            self.metrics.update(metrics)

        def log_hyperparams(self, params, *args, **kwargs):
            pass

    said: list[str] = []
    monkeypatch.setattr(compile_report, "rank_zero_info", said.append)
    logger = Scalars()
    trainer, _ = _fit(_model(), LayoutStrategy(compile={"backend": "eager"}), logger=logger)
    assert sum(isinstance(c, CompileReport) for c in trainer.callbacks) == 1
    assert len(said) == 1 and said[0].startswith("torch.compile: rank 0: ") and "most on any rank: 1 graphs, " \
        "0 recompiles" in said[0], said
    assert logger.metrics["compile/graphs"] == 1.0 and logger.metrics["compile/recompiles"] == 0.0
    assert "compile/backend_seconds" in logger.metrics
