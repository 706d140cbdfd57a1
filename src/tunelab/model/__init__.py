"""Model loading and the trainable-parameter set-up (full, freeze, LoRA, QLoRA)."""
