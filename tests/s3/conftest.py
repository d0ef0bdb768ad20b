"""S3 fixtures (s3_server, s3_env, bucket, prefix) are in tests/conftest.py: the SLURM tests use them too."""
