"""lmzoo sft (planned; see the open issues)."""
