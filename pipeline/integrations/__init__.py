"""The trainers users already run, on the commit protocol (docs/trainers.md).

* :mod:`pipeline.integrations.hf`: :class:`~pipeline.integrations.hf.CommittedTrainer`, a drop-in for the Hugging
  Face ``Trainer`` (``pip install 'race-free-ckpt[hf]'``).
* :mod:`pipeline.integrations.lightning`: :class:`~pipeline.integrations.lightning.CommittedCheckpoint`, a drop-in
  for PyTorch Lightning's ``ModelCheckpoint`` (``pip install 'race-free-ckpt[lightning]'``).
* :mod:`pipeline.integrations.accelerate`: :func:`~pipeline.integrations.accelerate.save_state` /
  :func:`~pipeline.integrations.accelerate.load_state`, a drop-in pair for Hugging Face Accelerate's
  ``accelerator.save_state()`` / ``load_state()`` (``pip install 'race-free-ckpt[accelerate]'``).

Each module imports its trainer's package: ``import pipeline.checkpoint`` never pulls one in.
"""
