"""lmzoo grpo: online reinforcement learning with verifiable rewards (GRPO and its variants) on the shared loop."""
