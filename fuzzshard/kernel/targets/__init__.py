"""Systems under test, one module each. A target turns a plain model into its
sharded form and says how a batch becomes a loss and how a sharded tensor
becomes a full one; the training loop and the oracles are shared."""
