"""A user's own package, as the README's "Bring your own model and data" uses it (``model._target_``)."""
