"""The chat floor: chat templates and their renders, assistant spans, row formats, tokens with loss masks, and the
chat data config, for every task that trains on conversations (sft, dpo, rm, grpo)."""
