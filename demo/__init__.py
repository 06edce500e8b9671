"""The fine-tuning main job (`zoo demo`): convert, score, LoRA SFT, score again, LoRA DPO, LoRA GRPO, export, chat.

The top floor: it drives convert/, eval/, pretrain/, sft/, dpo/ and grpo/ (demo/job.py); its dataset is demo/data/.
"""
