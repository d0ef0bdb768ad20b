"""Where checkpoints live: the store interface every backend implements (:mod:`.store`), a directory of a
(shared) filesystem, and a bucket (S3-compatible), with their status views and repairs."""
