"""Lightning's fit -> validate -> test -> save -> fit again on one GPU, under ZeRO-1, ZeRO-2 and ZeRO-3 (dp=1).

Between stages Lightning moves the model to the host and back; on CUDA that replaces ZeRO-1/2's bucket views and
moves FSDP2's modules, which the CPU contract tests (tests/launch/test_lightning_contract.py) cannot show. Checked here,
per stage: weights after validate and test equal those after fit (bit for bit), validate and test give the same loss,
a save after test works, and fit 3 + fit 2 more steps gives the losses of 5 steps in one fit (plain SGD, fp32, the
same batch every step). One JSON line per layout to --out; the last line printed is the summary.

    PYTHONPATH=. python benchmarks/gpu_contract.py --device cuda --out gpu_contract.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import traceback
from pathlib import Path

SEED, LR, BATCH, SEQ = 1234, 0.1, 4, 64


class _Data:
    def __init__(self, device_type: str) -> None:
        import torch

        gen = torch.Generator().manual_seed(SEED)
        # one row everywhere: whatever order a sampler draws, every batch is the same
        self.row = torch.randint(0, 256, (1, SEQ + 1), generator=gen).repeat(BATCH, 1)

    def loader(self, batches: int):
        from torch.utils.data import DataLoader, TensorDataset

        rows = self.row.repeat(batches, 1)
        return DataLoader(TensorDataset(rows[:, :-1], rows[:, 1:]), batch_size=BATCH)


def _weights(trainer) -> dict:
    import torch

    state = trainer.strategy.lightning_module_state_dict()
    out = {}
    for key, value in state.items():
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        out[key] = value.detach().to("cpu", torch.float32).clone()
    return out


def _module():
    import torch

    from lightning_par.examples import GPTLightningModule

    class Losses(GPTLightningModule):
        def __init__(self):
            super().__init__(preset="tiny", optimizer="sgd", lr=LR)
            self.train_losses: list[float] = []

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            value = loss["loss"] if isinstance(loss, dict) else loss
            self.train_losses.append(float(value.detach()))
            return loss

    torch.manual_seed(SEED)
    return Losses()


def run_layout(stage: int, device_type: str, root: Path) -> dict:
    import lightning.pytorch as pl
    import torch

    from lightning_par import ZeroStrategy

    data = _Data(device_type)
    common = dict(accelerator=device_type, devices=1, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                  limit_val_batches=2, default_root_dir=root, precision="32-true")
    fig: dict = {"stage": stage}

    # reference: 5 steps in one fit
    ref = _module()
    torch.manual_seed(SEED)  # the model is built in configure_model, at fit
    pl.Trainer(strategy=ZeroStrategy(stage=stage), max_steps=5, **common).fit(ref, data.loader(5))
    fig["one_fit_losses"] = ref.train_losses

    model = _module()
    trainer = pl.Trainer(strategy=ZeroStrategy(stage=stage), max_steps=3, **common)
    torch.manual_seed(SEED)
    trainer.fit(model, data.loader(3), data.loader(2))
    after_fit = _weights(trainer)
    val = trainer.validate(model, data.loader(2), verbose=False)[0]
    after_val = _weights(trainer)
    test = trainer.test(model, data.loader(2), verbose=False)[0]
    after_test = _weights(trainer)
    trainer.save_checkpoint(root / f"zero{stage}_after_test.ckpt")
    fig["validate"], fig["test"] = val, test
    fig["weights_changed_by_validate"] = sum(int(not torch.equal(after_fit[k], after_val[k])) for k in after_fit)
    fig["weights_changed_by_test"] = sum(int(not torch.equal(after_fit[k], after_test[k])) for k in after_fit)
    trainer.fit_loop.epoch_loop.max_steps = 5  # the same Trainer goes on for 2 more steps
    trainer.fit(model, data.loader(5), data.loader(2))
    fig["split_fit_losses"] = model.train_losses
    n = min(len(fig["one_fit_losses"]), len(model.train_losses))
    fig["max_loss_diff"] = max(abs(a - b) for a, b in zip(fig["one_fit_losses"][:n], model.train_losses[:n],
                                                          strict=True))
    fig["steps_compared"] = n
    return fig


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out", default="gpu_contract.jsonl")
    parser.add_argument("--stages", default="1,2,3")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    results, ok = [], True
    with tempfile.TemporaryDirectory() as tmp:
        for stage in (int(s) for s in args.stages.split(",")):
            start = time.time()
            line: dict = {"layout": f"zero{stage}", "device": args.device}
            try:
                line["figures"] = fig = run_layout(stage, args.device, Path(tmp))
                problems = []
                if fig["weights_changed_by_validate"] or fig["weights_changed_by_test"]:
                    problems.append("weights changed by an evaluation")
                if abs(fig["validate"]["val/loss"] - fig["test"]["test/loss"]) > 1e-6:
                    problems.append("validate and test losses differ")
                if fig["steps_compared"] < 5 or fig["max_loss_diff"] > 1e-5:
                    problems.append(f"split fit differs by {fig['max_loss_diff']:.3g} over {fig['steps_compared']}")
                line["ok"], line["error"] = not problems, "; ".join(problems) or None
            except Exception as err:  # noqa: BLE001 -- one layout's failure is its line, the others still run
                line["ok"], line["error"] = False, f"{type(err).__name__}: {err}"[:400]
                traceback.print_exc()
            line["seconds"] = round(time.time() - start, 1)
            ok &= line["ok"]
            results.append(line)
            with open(args.out, "a") as out:
                out.write(json.dumps(line) + "\n")
    for line in results:
        fig = line.get("figures", {})
        print(f"{line['layout']:6} {'ok' if line['ok'] else 'FAILED':6} {line['seconds']:6.1f} s  "
              f"split-vs-one-fit {fig.get('max_loss_diff', float('nan')):.2e}  {line['error'] or ''}")
    print(f"gpu_contract: {sum(r['ok'] for r in results)} of {len(results)} layouts ok")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
