"""Training: the Trainer subclass, losses, callbacks and one short workflow per stage."""
