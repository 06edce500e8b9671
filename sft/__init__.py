"""lmzoo sft: supervised fine-tuning (full or LoRA) on the shared loop; its rows, templates and masks are chat/'s."""
