"""The save path: a rank's state becomes a DCP state dict, is staged (synchronously or in the background),
marked done with sizes and hashes; incremental pieces, the portable view, DeepSpeed engines."""
