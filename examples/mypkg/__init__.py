"""A user's own package, as docs/your-model-and-data.md uses it (``model._target_``)."""
