"""Using trained models: generation, evaluation with metrics."""
