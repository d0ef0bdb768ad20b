"""The app's run directory: its paths (:mod:`~pipeline.rundir.layout`) and finding a run by id, ``run.yaml`` as
plain data (:mod:`~pipeline.rundir.runs`).

The lowest layer of the app: the config, the stage kit, the stages, the driver and ``python -m pipeline.status``
read it; the library (``pipeline.checkpoint``, ``pipeline.storage``, ``pipeline.formats``) never does. Nothing
here imports Hydra or the config schema.
"""
