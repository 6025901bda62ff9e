"""`pagedllm batch`: files of prompts through the offline engine (files.py reads and writes, runner.py feeds)."""
