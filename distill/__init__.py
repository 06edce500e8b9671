"""On-policy distillation (GKD): a student trained on a frozen teacher's token distributions."""
