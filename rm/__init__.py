"""Reward models: Bradley-Terry scorers trained on preference pairs (`reward train`)."""
