"""Run supervision: what keeps a multi-rank run going, stops it together, or resumes it as the same run.

None of it transforms the model (that is :mod:`lightning_par.parallel`, which imports nothing from here); the
strategies, the checkpoint plugins, the CLI and the data module call it. Its modules:

- ``heartbeat``: a rank that dies or freezes is named within a bound, and the others stop (exit 75);
- ``shutdown``: the process group destroyed before the interpreter finalizes, so a run that completed exits 0;
- ``preemption``: SIGTERM ends the run at the next optimizer step, with a checkpoint every rank agreed on;
- ``bad_steps``: a non-finite loss or gradient norm, caught on every rank at once, never costs the last finite
  checkpoint;
- ``job_store``: one job, one store (a second job on a held port is refused before it joins the group);
- ``data_order``: the training samples' order, a function of (seed, epoch, dataset length) only;
- ``data_position``: where the training loader stands, saved in a checkpoint and resumed from it;
- ``elastic``: an attempt on another world size goes on as the same run.

Nothing is imported here: each module is imported where it is used.
"""
