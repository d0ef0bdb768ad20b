"""Fixtures: ``s3_server``, ``s3_env``, ``bucket`` and ``prefix`` live in ``tests/conftest.py`` (SLURM tests use them too)."""
