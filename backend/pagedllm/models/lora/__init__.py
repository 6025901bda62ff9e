"""LoRA adapters: PEFT directories read and checked (adapter.py), and the batched per-slot deltas the model's
layers add (layers.py)."""
