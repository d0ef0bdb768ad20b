"""The kit every stage is built from, below the stages: what a stage declares and the run state it reads.

* :mod:`~pipeline.stagekit.contract`: a stage's declared contract (name, needs, produces, tasks, resources), the
  stage order, and the context a task receives;
* :mod:`~pipeline.stagekit.records`: stage records (``stages/<stage>.json``), who is alive, the resume command;
* :mod:`~pipeline.stagekit.jobs`: what the scheduler (SLURM, or a local pid) says about a job;
* :mod:`~pipeline.stagekit.preemption`: SLURM's time limit and preemption inside a job (USR2, requeue);
* :mod:`~pipeline.stagekit.checkpoint_store`: the run's checkpoint store (run dir or bucket) from its config.

Stages import this package; it imports no stage and nothing of :mod:`pipeline.driver` above them.
"""
