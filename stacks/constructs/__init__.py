"""Resource families, one per module; stacks only wire them together."""
