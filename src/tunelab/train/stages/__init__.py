"""One workflow per stage: load data and model, train, save."""
