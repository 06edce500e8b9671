"""lmzoo pretrain (planned; see the open issues)."""
