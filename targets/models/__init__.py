"""Full-model target pairs."""
