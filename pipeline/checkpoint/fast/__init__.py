"""The fast tier: each rank's state every K steps in node-local storage and on peer nodes, verified on restore.

:mod:`.tier` saves (in the background), :mod:`.restore` picks the newest step every rank can restore from
verified copies (falling back copy by copy, then to the durable tier, within one restart), :mod:`.local` owns
the node-local files, :mod:`.codec` turns a rank's state into one blob and back without pickle.
"""

RESUMED_FILE = "resumed.json"
"""``checkpoints/resumed.json``: how the last launch resumed (written by rank 0; ``status`` shows it)."""
