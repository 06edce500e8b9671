"""lmzoo dpo (planned; see the open issues)."""
