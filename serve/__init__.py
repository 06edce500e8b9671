"""`zoo serve`: an OpenAI-compatible HTTP server over the inference engine (eval/engine/).

Floor 4: it reads zoo/ (checkpoints), eval/ (the engine) and chat/ (templates, tool-call parsers). One module a
job: cli.py (the command and its flags), model.py (what a checkpoint serves), runner.py (the engine's thread),
schema.py (request fields -> SamplingParams), chat.py (messages -> prompt ids; tool calls out), text.py (tokens ->
text, stop strings), app.py (the routes), errors.py (OpenAI-shaped error bodies).
"""
