"""One error, once (issue 27): ``lightning-par fit`` given an input it cannot take ends with one ``error:`` line that
names the cause and the fix, and that line is the last thing printed -- before launch (in the launching process)
and at setup (on every rank: no ``Cannot copy out of meta tensor`` from the teardown after it, no traceback).
``LIGHTNING_PAR_TRACEBACK=1`` gives the traceback instead (docs/cli.md).

The bad inputs of issue 27 that reach ``fit``: a model whose blocks are not in an nn.ModuleList, without
``block_types=``, under ZeRO-3 (launched, default set, ~15 s) and under a pipeline (full set); a model without a
``tp_plan`` under ``megatron_tp2`` (full set); a layout that does not fit the world (in this process). (The refusals
of a fused projection split ``colwise`` and of attention reshaping with the global head count are setup-time
LayoutErrors too, and take the same path.) tests/launch/test_bad_inputs.py's own bad inputs end the same way.
"""

from __future__ import annotations

import pytest

from lightning_par import LayoutError
from lightning_par.cli import TRACEBACK_ENV, main
from tests.harness import launch_command

CPU_JOB = ["--model=lightning_par.examples.GPTLightningModule", "--model.preset=tiny",
           "--data=lightning_par.data.TextDataModule", "--trainer.accelerator=cpu"]
TOO_FEW_RANKS = ["--trainer.devices=2", "--trainer.strategy=lightning_par.LayoutStrategy", "--trainer.strategy.dp=3"]
SAID = ('lightning-par: error: dp=3 x tp=1 x pp=1 = 3, but the world size is 2. Set dp="auto" (it becomes 2) or '
        "change devices x num_nodes to 3.")


def _last_lines(text: str, n: int = 1) -> list[str]:
    return [line for line in text.splitlines() if line.strip()][-n:]


def test_an_error_before_launch_is_one_line(capsys, monkeypatch):
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    with pytest.raises(SystemExit) as exit_:
        main(["fit", *CPU_JOB, *TOO_FEW_RANKS])
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert _last_lines(err) == [SAID]
    assert "Traceback" not in err


def test_the_traceback_on_request(monkeypatch):
    monkeypatch.setenv(TRACEBACK_ENV, "1")
    with pytest.raises(LayoutError, match=r"^dp=3 x tp=1 x pp=1 = 3, but the world size is 2\."):
        main(["fit", *CPU_JOB, *TOO_FEW_RANKS])


#: strategy -> the error every rank ends with, for tests.launch.readme_model.SequentialModule (blocks in an
#: nn.Sequential, large enough that configure_model leaves tensors on the meta device)
SETUP_ERRORS = {
    "zero3": "lightning-par: error: found no repeated blocks in SequentialModule: it declares no `pipeline_units()`",
    "pipeline2_1f1b": "lightning-par: error: found no repeated blocks in SequentialModule: it declares no "
                      "`pipeline_units()`",
    "megatron_tp2": "lightning-par: error: SequentialModule declares no tensor-parallel plan, so tp=2 cannot split "
                    "it. Add a `tp_plan`",
}


@pytest.mark.parametrize("strategy", [pytest.param(s, marks=pytest.mark.launch(ranks=2, full=s != "zero3"))
                                      for s in SETUP_ERRORS])  # a launch per bad input: zero3 by default
def test_a_setup_error_is_the_last_line_on_every_rank(strategy, tmp_path, cache_dir):
    argv = ["fit", "--model=tests.launch.readme_model.SequentialModule", "--model.dim=128",
            "--data=lightning_par.data.TextDataModule", "--data.seq_len=16", "--data.max_corpus_bytes=100000",
            f"--data.cache_dir={cache_dir}", "--trainer.accelerator=cpu", "--trainer.devices=2",
            f"--trainer.strategy={strategy}", "--trainer.max_steps=2", "--sample_tokens=0"]
    run = launch_command(tmp_path, cache_dir, argv, timeout=300)
    assert run.returncode == 1, run.log[-3000:]
    last = _last_lines(run.log, 2)
    assert all(line.startswith(SETUP_ERRORS[strategy]) for line in last), run.log[-3000:]  # rank 0 and rank 1
    assert last[0] == last[1]
    if strategy != "megatron_tp2":
        assert "block_types=[YourBlock]" in last[0]  # the fix, named
    assert "meta tensor" not in run.log and "Traceback" not in run.log, run.log[-3000:]
