"""Other engines as rollout paths."""
