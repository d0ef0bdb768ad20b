"""The driver, above the stages: it plans a launch, runs the stages' jobs and shows where a run stands.

* :mod:`~pipeline.driver.plan`: the plan as a value (each stage's launch id, tasks, resources, dependencies, skip
  reason), read by the runner, ``dry_run``, status and the launchers;
* :mod:`~pipeline.driver.runner`: one launch end to end (lease, run.yaml, plan, supervise, summary);
* :mod:`~pipeline.driver.supervise`: submits the planned jobs, watches them, restarts and interrupts;
* :mod:`~pipeline.driver.task`: runs one stage's task inside its job (the launchers call it);
* :mod:`~pipeline.driver.lease`: one launching process owns a run at a time;
* :mod:`~pipeline.driver.progress`, :mod:`~pipeline.driver.status_view`: live progress and the status view;
* :mod:`~pipeline.driver.run_status`, :mod:`~pipeline.checkpoint.stores.bucket_status`: a run's status as data (run dir
  or bucket), also read by ``python -m pipeline.status``, which loads no Hydra, config or stage module.

Only the launchers and the entry points import this package.
"""
