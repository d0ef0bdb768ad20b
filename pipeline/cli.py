"""Command line: ``python -m pipeline +experiment=<name> [key=value ...]``."""

from __future__ import annotations

import sys

from pipeline.config.compose import load_config, to_yaml
from pipeline.errors import PipelineError
from pipeline.stages import ORDER, get_stage


def main(argv: list[str]) -> int:
    try:
        cfg = load_config(argv)
        if cfg.dry_run:
            print(to_yaml(cfg))
            for name in ORDER:
                c = get_stage(name).CONTRACT
                print(f"{c.job_name:16} tasks={c.num_tasks(cfg)} needs={','.join(c.needs) or '-'} -> {c.produces}")
            return 0
        from launchers.factory import make_launcher  # noqa: PLC0415 - submitit only when launching
        from pipeline.orchestration import runner  # noqa: PLC0415

        runner.run(cfg, make_launcher(cfg.launcher))
        return 0
    except PipelineError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
