"""Training and evaluation engine: sharding, jitted steps, the run loop, checkpoints and results."""
