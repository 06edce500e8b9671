"""The fine-tuning main job (`zoo demo`): convert, score, LoRA SFT, score again, LoRA DPO, LoRA GRPO, export, chat.

The top floor: it drives convert/, eval/, pretrain/, sft/, dpo/ and grpo/ (demo/job.py); its dataset is demo/data/.
This file holds only the default chat prompt, so that the `zoo` parser can show it in `zoo demo --help`
without loading the job.
"""

# The chat prompt answered at the end, by the base and the fine-tuned model (`zoo demo --prompt`).
DEMO_PROMPT = "Extract the record from this sentence:\nGiulia, aged 29, moved to Vienna last spring."
