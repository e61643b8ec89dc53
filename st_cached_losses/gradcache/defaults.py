"""Defaults shared by the losses and the command line, in a module that imports nothing (the command line reads
them before it loads sentence-transformers)."""

# Rows per embedding mini-batch when neither the loss nor its base loss says (stock CachedMNRL's default too).
DEFAULT_MINI_BATCH_SIZE = 32
