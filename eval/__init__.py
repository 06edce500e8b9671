"""Evaluation: generation and scored tasks (reached as `zoo generate` / `zoo eval`)."""
