"""PSM training (python -m train.main, arriving with the training issue) and its data pipeline."""
