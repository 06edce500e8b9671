"""lmzoo's one training loop, shared by every task: config -> mesh -> data (grain lanes) -> jitted step -> checkpoints.

Pretraining (continued pretraining on plain text) is its simplest task
(``pretrain train``); the fine-tuning tasks plug into the same seam (pretrain/task.py).
"""
