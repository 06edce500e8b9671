"""lmzoo sft: supervised fine-tuning (full or LoRA) on the shared loop: example formats, chat templates, loss masks."""
