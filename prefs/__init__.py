"""The preference-data floor: preference pairs and KTO's unpaired rows as pair-layout documents (the prompt once,
each answer its own segment), the shared-prefix layout, pair loading, and their batches (dpo, rm)."""
